"""The demo's processes: its workers, those it must leave none of, Ctrl-C while cleaning up.

Its ``airflow dags test`` workers, the processes it must leave none of, and Ctrl-C while it
cleans up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.demo.output import DemoFailure, rel
from devtools.workers import kill_group


@dataclass
class Worker:
    """One ``airflow dags test`` process, in its own process group and Airflow home."""

    name: str
    proc: subprocess.Popen[str]
    log: Path

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise DemoFailure(
                f"`airflow dags test` ({self.name}) did not finish in {timeout:.0f} s; "
                f"its log: {rel(self.log)}"
            ) from None

    def kill(self) -> None:
        kill_group(self.proc)

    def text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int((Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split())[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def leftover_processes(home_prefix: Path, db_name: str, wait: float = 0.0) -> list[str]:
    """Live processes (other than this one and its parents) that belong to this demo: an
    AIRFLOW_HOME under the work folder, or the demo database in their command line or
    environment (the accounting service, Airflow processes, PostgreSQL backends).

    ``wait``: seconds to give them to exit (backends of a closed connection take a moment).
    """
    deadline = time.monotonic() + wait
    left = _leftovers(home_prefix, db_name)
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = _leftovers(home_prefix, db_name)
    return left


def _leftovers(home_prefix: Path, db_name: str) -> list[str]:
    found = []
    home = f"AIRFLOW_HOME={home_prefix}{os.sep}".encode()
    name = db_name.encode() if db_name else None
    skip = _ancestors()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state in "ZX":
            continue
        ours = any(v.startswith(home) for v in environ.split(b"\0"))
        if name and (name in cmdline or name in environ):
            ours = True
        if ours:
            text = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {text[:160]}")
    return found


_cleaning = False


def on_signal(signum: int, _frame: Any) -> None:
    if _cleaning:
        print("\n(stopping everything the demo started, please wait ...)", file=sys.stderr)
        return
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Ctrl-C and SIGTERM do not interrupt the block (used while stopping processes)."""
    global _cleaning
    before, _cleaning = _cleaning, True
    try:
        yield
    finally:
        _cleaning = before


def cleaning_begins() -> None:
    global _cleaning
    _cleaning = True
