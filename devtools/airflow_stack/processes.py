"""The stack's processes: each component in its own session and process group, found and killed.

Nothing here speaks to Airflow: a component is a command line, a log file in
``<home>/stack-logs/`` and a process group (the task processes write their logs under
``<home>/logs/``). :meth:`StackProcesses.tree` finds every process of the stack (also those
a component started, and those that only carry ``AIRFLOW_HOME``), and
:meth:`StackProcesses.stop` kills them all, or raises.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

_T = TypeVar("_T")

# Runs `airflow ARGS` with the hostname argv[1], in the new UTS namespace `unshare --uts`
# made for it: socket.gethostname() then names this worker, as on a separate machine.
_WITH_HOSTNAME = (
    "import os, socket, sys; socket.sethostname(sys.argv[1]); "
    "os.execv(sys.executable, [sys.executable, '-m', 'airflow', *sys.argv[2:]])"
)


class StackError(RuntimeError):
    """Something in the stack did not come up, or did not finish, in time."""


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a text file ('' if it does not exist)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class ProcInfo:
    """One line of /proc/<pid>/stat: enough to tell a process apart from a reused pid."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    start_ticks: int
    state: str


def proc_table() -> dict[int, ProcInfo]:
    """Every process on the machine, from /proc (Linux)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[1].split()
        pid = int(entry.name)
        table[pid] = ProcInfo(
            pid, int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]), fields[0]
        )
    return table


def is_alive(info: ProcInfo) -> bool:
    """True if that very process (same pid AND start time) exists and is not a zombie."""
    now = proc_table().get(info.pid)
    return now is not None and now.start_ticks == info.start_ticks and now.state not in "ZX"


def processes_with_home(home: Path) -> list[int]:
    """Pids of live processes whose environment has ``AIRFLOW_HOME=<home>`` (via /proc).

    Misses processes that rename themselves with setproctitle (the api-server, the
    LocalExecutor workers): that overwrites /proc/<pid>/environ. Use
    :meth:`StackProcesses.tree`.
    """
    needle = f"AIRFLOW_HOME={home}".encode()
    pids = []
    for pid, info in proc_table().items():
        if pid == os.getpid() or info.state in "ZX":
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(pid)
    return pids


class StackProcesses:
    """The components of a stack as background processes of ``home``, run with ``env``, and
    their logs."""

    def __init__(self, home: Path, env: dict[str, str], port: int, components: Sequence[str]):
        self.home = home
        self.env = env
        self.port = port
        self.components = list(components)
        self.log_dir = home / "stack-logs"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def log_path(self, component: str) -> Path:
        return self.log_dir / f"{component}.log"

    def task_log(
        self, dag_id: str, run_id: str, task_id: str, try_number: int | None = None
    ) -> str:
        """The task's log file (latest attempt by default), '' if there is none."""
        folder = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        files = sorted(folder.glob("attempt=*.log"), key=lambda p: int(p.stem.split("=")[1]))
        if try_number is not None:
            files = [f for f in files if f.stem == f"attempt={try_number}"]
        return files[-1].read_text(encoding="utf-8", errors="replace") if files else ""

    def start_component(self, name: str) -> None:
        """Start one component (``api-server``, ``scheduler``, ``dag-processor``,
        ``triggerer`` or ``celery-worker-<name>``) in its own session, logging to its file."""
        if name.startswith("celery-worker-"):
            hostname = name.removeprefix("celery-worker-")
            queue = self.env["AIRFLOW__OPERATORS__DEFAULT_QUEUE"]
            command = [
                "unshare", "--uts", "--", sys.executable, "-c", _WITH_HOSTNAME, hostname,
                "celery", "worker", "--celery-hostname", f"{hostname}@{hostname}",
                "--queues", queue, "--skip-serve-logs", "--without-mingle", "--without-gossip",
            ]  # fmt: skip
        else:
            args = {
                "api-server": ["api-server", "--host", "127.0.0.1", "--port", str(self.port)],
                "scheduler": ["scheduler", "--skip-serve-logs"],
                "dag-processor": ["dag-processor"],
                "triggerer": ["triggerer", "--skip-serve-logs"],
            }
            command = [sys.executable, "-m", "airflow", *args[name]]
        with open(self.log_path(name), "ab") as log:
            self.procs[name] = subprocess.Popen(
                command,
                env=self.env,
                cwd=self.home,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def restart_component(self, name: str) -> None:
        """SIGKILL one component (with everything it started) and start it again with
        :attr:`env` as it is now."""
        if name in self.procs:
            self.kill_component(name)
        self.start_component(name)

    def kill_component(self, name: str) -> None:
        """SIGKILL one component with everything it started (a machine that died): its
        process group and every descendant. The stack then runs without it."""
        proc = self.procs.pop(name)
        table = proc_table()
        doomed = {proc.pid} | {i.pid for i in table.values() if i.pgid == proc.pid}
        todo = list(doomed)
        while todo:
            parent = todo.pop()
            for info in table.values():
                if info.ppid == parent and info.pid not in doomed:
                    doomed.add(info.pid)
                    todo.append(info.pid)
        for pid in doomed:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=15)

    def tree(self) -> list[ProcInfo]:
        """The stack's processes: the components, everything in their sessions and process
        groups, their descendants, and whatever else has ``AIRFLOW_HOME=<our home>``."""
        table = proc_table()
        roots = {p.pid for p in self.procs.values()}
        found = {
            pid
            for pid, info in table.items()
            if pid in roots or info.sid in roots or info.pgid in roots
        }
        found.update(processes_with_home(self.home))
        children: dict[int, list[int]] = {}
        for info in table.values():
            children.setdefault(info.ppid, []).append(info.pid)
        todo = list(found)
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return [table[pid] for pid in sorted(found) if pid in table and table[pid].state != "Z"]

    def stop(self, timeout: float = 15.0) -> None:
        """SIGKILL the components' process groups and every other process of :meth:`tree`;
        raise if any of them is still alive after ``timeout``."""
        doomed = self.tree()
        for proc in self.procs.values():
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for info in doomed:
            with suppress(ProcessLookupError):
                os.kill(info.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while left := [i for i in doomed if is_alive(i)] + [
            i for i in self.tree() if i.pid not in {p.pid for p in self.procs.values()}
        ]:
            if time.monotonic() > deadline:
                raise StackError(f"processes still alive after stop: {left}")
            for info in left:
                with suppress(ProcessLookupError):
                    os.kill(info.pid, signal.SIGKILL)
            time.sleep(0.1)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise StackError(
                    f"airflow {name} exited with code {proc.returncode}; "
                    f"tail of {self.log_path(name)}:\n{tail(self.log_path(name))}"
                )

    def _wait(
        self,
        predicate: Callable[[], _T | None],
        timeout: float,
        what: str,
        log: str | None = "api-server",
        interval: float = 0.25,
        describe: Callable[[], str] | None = None,
    ) -> _T:
        """Poll ``predicate`` until it returns neither None nor False, while every component
        lives; on timeout raise with ``describe()`` and the tail of the ``log`` component's
        log file."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            result = predicate()
            if result is not None and result is not False:  # [] is a valid result
                return result
            if time.monotonic() > deadline:
                detail = f"\n{describe()}" if describe else ""
                logs = ""
                if log:
                    logs = f"\ntail of {self.log_path(log)}:\n{tail(self.log_path(log))}"
                raise StackError(f"timed out after {timeout:.0f}s waiting for {what}{detail}{logs}")
            time.sleep(interval)
