"""A real Airflow 3 stack (api-server, scheduler, dag-processor) as background processes.

For end-to-end tests and the demo: ``airflow backfill create`` and ``airflow dags trigger``
only make tasks run when a scheduler, an api-server (the task runner talks to its execution
API) and a dag-processor (Airflow 3 parses DAG files in a separate process, the scheduler
does not) are running. :func:`airflow_stack` starts them against an isolated
``AIRFLOW_HOME`` (SQLite metadata, LocalExecutor), each in its own session / process group
with its log in ``<home>/stack-logs/``, and kills the groups on exit.

``metadata_dsn`` puts the metadata in a PostgreSQL database instead (as in production), and
``celery_workers`` switches to the CeleryExecutor (Redis broker, Postgres result backend):
one ``airflow celery worker`` per name, each in its own UTS namespace with that hostname, so
that Airflow and the provider see separate hosts.

The caller's ``os.environ`` is never modified: the stack's environment is
:attr:`AirflowStack.env`, passed to every subprocess. State is read straight from the
SQLite metadata database (read-only, WAL mode): an ``airflow`` CLI call costs ~4 s of
imports, a query a millisecond.

Usage::

    with airflow_stack(tmp_path / "home", Path("dags"), extra_env={"X": "1"}) as stack:
        stack.unpause("my_dag")
        runs = stack.backfill("my_dag", "2026-10-01", "2026-10-03")
        assert {r.state for r in runs} == {"success"}
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager, suppress
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar
from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict

from devtools import airflow_env

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

TERMINAL_RUN_STATES = frozenset({"success", "failed"})
TERMINAL_TI_STATES = frozenset({"success", "failed", "skipped", "upstream_failed", "removed"})

_T = TypeVar("_T")

REDIS_URL = os.environ.get("IDEMPOTENCY_REDIS_URL", "redis://127.0.0.1:6379/0")


def sqlalchemy_url(dsn: str, driver: str = "postgresql+psycopg2") -> str:
    """The SQLAlchemy URL of a libpq DSN (Airflow's metadata connection, Celery's backend)."""
    params = conninfo_to_dict(dsn)
    user = quote(str(params.get("user", "postgres")), safe="")
    password = params.get("password")
    auth = f"{user}:{quote(str(password), safe='')}" if password else user
    host = str(params.get("host", "127.0.0.1"))
    port = str(params.get("port", "5432"))
    dbname = quote(str(params.get("dbname", "postgres")))
    if host.startswith("/"):  # a Unix socket folder (the embedded server): a query parameter
        return f"{driver}://{auth}@/{dbname}?host={quote(host, safe='/')}&port={port}"
    return f"{driver}://{auth}@{host}:{port}/{dbname}"


def celery_env(metadata_dsn: str, broker_url: str = REDIS_URL) -> dict[str, str]:
    """The CeleryExecutor settings of a stack: Redis broker, results in the metadata DB, a
    queue of its own (several stacks may share one Redis), and short timeouts for a worker
    that died (the scheduler fails its running tasks into their retries after 30 s, and
    requeues what it had queued after 60 s, instead of 5 and 10 minutes)."""
    return {
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CELERY__BROKER_URL": broker_url,
        "AIRFLOW__CELERY__RESULT_BACKEND": sqlalchemy_url(metadata_dsn, "db+postgresql"),
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
        "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "3600",
        "AIRFLOW__OPERATORS__DEFAULT_QUEUE": f"idem-{secrets.token_hex(4)}",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "60",
    }


# Runs `airflow ARGS` with the hostname argv[1], in the new UTS namespace `unshare --uts`
# made for it: socket.gethostname() then names this worker, as on a separate machine.
_WITH_HOSTNAME = (
    "import os, socket, sys; socket.sethostname(sys.argv[1]); "
    "os.execv(sys.executable, [sys.executable, '-m', 'airflow', *sys.argv[2:]])"
)


def stack_env_defaults(home: Path, dags_folder: Path, port: int) -> dict[str, str]:
    """The settings the stack adds on top of :func:`devtools.airflow_env.configure`."""
    return {
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        # Task runners (LocalExecutor workers) report to the execution API of OUR api-server.
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__WORKERS": "1",
        # Unpausing must not create a scheduled__<today> run next to the backfill runs.
        "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
        "AIRFLOW__SCHEDULER__CATCHUP_BY_DEFAULT": "False",
        # Fast pick-up: the dags-folder bundle is re-listed every 300 s by default and
        # each file re-parsed every 30 s.
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "2",
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "5",
        "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
        "AIRFLOW__DAG_PROCESSOR__PRINT_STATS_INTERVAL": "0",
        "AIRFLOW__DAG_PROCESSOR__STALE_DAG_THRESHOLD": "10",
        # Default is $TMPDIR/airflow, shared by every Airflow on the machine.
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH": str(home / "bundles"),
        # Faster than the defaults (5 s / 1 s), but every heartbeat is a SQLite write and
        # more writers mean more "database is locked" (see AirflowStack.airflow_retrying).
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.5",
        "AIRFLOW__SCHEDULER__PARSING_CLEANUP_INTERVAL": "5",
        # No login for the UI / REST API of a throw-away local stack.
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__CORE__PARALLELISM": "4",
        # Log servers bind fixed ports (8793/8794); the stack starts them with
        # --skip-serve-logs, this is a second line of defence against collisions.
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
    }


def migrated_db_template() -> Path:
    """A freshly migrated, empty metadata DB, made once per Airflow version (~6 s saved).

    ``airflow db migrate`` only writes the schema, ``alembic_version``, ``log_template`` and
    the default pool: nothing that depends on AIRFLOW_HOME, so a copy serves every home.
    """
    version = importlib.metadata.version("apache-airflow")
    template = Path(tempfile.gettempdir()) / f"idem-airflow-{version}-migrated.db"
    if template.exists():
        return template
    scratch = Path(tempfile.mkdtemp(prefix="idem-airflow-template-"))
    env = dict(os.environ)
    airflow_env.configure(scratch, env)
    airflow_env.migrate(env)
    tmp = template.with_name(f"{template.name}.{os.getpid()}.tmp")
    # The backup API folds the WAL into one self-contained file.
    with (
        closing(sqlite3.connect(scratch / "airflow.db")) as src,
        closing(sqlite3.connect(tmp)) as dst,
    ):
        src.backup(dst)
    os.replace(tmp, template)
    return template


class StackError(RuntimeError):
    """Something in the stack did not come up, or did not finish, in time."""


@dataclass(frozen=True)
class RunResult:
    """One DAG run, as stored in the metadata DB."""

    run_id: str
    logical_date: datetime | None
    state: str | None
    run_type: str
    backfill_id: int | None = None
    clear_number: int = 0
    conf: dict[str, Any] | None = None


@dataclass(frozen=True)
class TaskInstanceResult:
    """One task instance of a run (try_number counts every attempt, also after a clear)."""

    task_id: str
    map_index: int
    state: str | None
    try_number: int
    max_tries: int


@dataclass(frozen=True)
class BackfillEntry:
    """One date of a backfill: a run created or cleared, or the reason it was skipped."""

    logical_date: datetime | None
    run_id: str | None
    state: str | None
    exception_reason: str | None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _parse_ts(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    parsed = datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def _date_arg(value: date | datetime | str) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, date):
        return value.isoformat()
    return value


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
    LocalExecutor workers): that overwrites /proc/<pid>/environ. Use :meth:`AirflowStack.tree`.
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


class AirflowStack:
    """Handles to a running stack: run CLI commands, trigger, backfill, read states."""

    def __init__(
        self,
        home: Path,
        dags_folder: Path,
        extra_env: dict[str, str] | None = None,
        port: int | None = None,
        *,
        dag_processor: bool = True,
        triggerer: bool = False,
        db_template: bool = True,
        metadata_dsn: str | None = None,
        celery_workers: Sequence[str] = (),
    ) -> None:
        if celery_workers and metadata_dsn is None:
            raise ValueError("celery_workers need a metadata_dsn (a PostgreSQL metadata DB)")
        self.home = home.resolve()
        self.db_template = db_template and metadata_dsn is None
        self.metadata_dsn = metadata_dsn
        self.dags_folder = dags_folder.resolve()
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_dir = self.home / "stack-logs"
        self.db_path = self.home / "airflow.db"
        self.components = ["api-server", "scheduler"]
        if dag_processor:
            self.components.append("dag-processor")
        if triggerer:
            self.components.append("triggerer")
        self.celery_workers = list(celery_workers)
        self.components += [f"celery-worker-{name}" for name in self.celery_workers]
        env = dict(os.environ)
        airflow_env.configure(self.home, env)
        env.update(stack_env_defaults(self.home, self.dags_folder, self.port))
        if metadata_dsn is not None:
            env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = sqlalchemy_url(metadata_dsn)
        if celery_workers:
            assert metadata_dsn is not None
            env.update(celery_env(metadata_dsn))
        env.update(extra_env or {})
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started_at: datetime | None = None
        self.timings: dict[str, float] = {}

    # ---------------------------------------------------------------- life cycle

    def log_path(self, component: str) -> Path:
        return self.log_dir / f"{component}.log"

    def start(self, timeout: float = 120.0) -> None:
        """Migrate the DB, start the components, wait until the api-server and scheduler answer."""
        t0 = time.monotonic()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.db_template and not self.db_path.exists():
            shutil.copyfile(migrated_db_template(), self.db_path)
        else:
            airflow_env.migrate(self.env)
        self.timings["db"] = time.monotonic() - t0
        self.started_at = datetime.now(timezone.utc)
        for name in self.components:
            self.start_component(name)
        self._wait(self._api_ready, timeout, "the api-server to answer /api/v2/monitor/health")
        self.timings["api_ready"] = time.monotonic() - t0
        self._wait(self._scheduler_ready, timeout, "the scheduler to heartbeat", "scheduler")
        self.timings["start"] = time.monotonic() - t0

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

    def restart_component(self, name: str, timeout: float = 180.0) -> None:
        """SIGKILL one component (with everything it started: a scheduler's task processes)
        and start it again with :attr:`env` as it is now; for the scheduler, wait until the
        new one heartbeats."""
        since = datetime.now(timezone.utc)
        if name in self.procs:
            self.kill_component(name)
        self.start_component(name)
        if name == "scheduler":
            what = "the restarted scheduler to heartbeat"
            self._wait(lambda: self._scheduler_ready(since), timeout, what, "scheduler")

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
        """Poll ``predicate`` until it returns neither None nor False; on timeout raise with
        ``describe()`` and the tail of the ``log`` component's log file."""
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

    def health(self) -> dict[str, Any] | None:
        """``GET /api/v2/monitor/health`` as a dict, or None if the api-server does not answer."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/api/v2/monitor/health", timeout=2) as r:
                return dict(json.load(r))
        except (OSError, ValueError):
            return None

    def _api_ready(self) -> bool:
        return self.health() is not None

    def _scheduler_ready(self, since: datetime | None = None) -> bool:
        since = since or self.started_at
        assert since is not None
        row = self._query_one(
            "SELECT max(latest_heartbeat) FROM job WHERE job_type = 'SchedulerJob' "
            "AND state = 'running'"
        )
        beat = _parse_ts(row[0]) if row else None
        return beat is not None and beat >= since

    # ---------------------------------------------------------------- CLI and API

    def airflow(
        self, *args: str, check: bool = True, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``airflow *args`` against this stack's home; raise with its output if it fails."""
        proc = subprocess.run(
            [sys.executable, "-m", "airflow", *args],
            env=self.env,
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise _cli_error(args, proc)
        return proc

    def airflow_retrying(
        self, *args: str, attempts: int = 5, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """:meth:`airflow`, run again while it fails with SQLite's "database is locked".

        SQLite lets one writer at a time; a transaction that read before writing fails at
        once (no busy wait) when another process committed in between. The scheduler, the
        dag-processor and the api-server write all the time, so CLI writes lose now and then.
        """
        for attempt in range(1, attempts + 1):
            proc = self.airflow(*args, check=False, timeout=timeout)
            locked = "database is locked" in proc.stderr + proc.stdout
            if proc.returncode == 0 or not locked or attempt == attempts:
                break
            time.sleep(0.5 * attempt)
        if proc.returncode != 0:
            raise _cli_error(args, proc, f" (attempt {attempt})")
        return proc

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """Call the REST API (``/api/v2/...``); the stack runs with all users admin."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.base_url}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                payload = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise StackError(f"{method} {path} -> {e.code}: {detail}") from e
        return json.loads(payload) if payload else None

    # ---------------------------------------------------------------- metadata DB

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        """Run a read-only query on the metadata DB (``?`` placeholders); rows are indexed
        by position and by column name, on SQLite and on PostgreSQL alike."""
        if self.metadata_dsn is not None:
            with psycopg.connect(self.metadata_dsn, row_factory=_name_and_index_rows) as conn:
                conn.read_only = True
                return conn.execute(sql.replace("?", "%s"), params).fetchall()
        uri = f"file:{self.db_path}?mode=ro"
        with closing(sqlite3.connect(uri, uri=True, timeout=30)) as lite:
            lite.row_factory = sqlite3.Row
            return list(lite.execute(sql, params))

    def _query_one(self, sql: str, params: Sequence[Any] = ()) -> Any:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    @staticmethod
    def _run(row: Any) -> RunResult:
        conf = row["conf"]
        if isinstance(conf, bytes | str) and conf:
            try:
                conf = json.loads(conf)
            except ValueError:
                conf = None  # older schemas pickled conf
        return RunResult(
            run_id=row["run_id"],
            logical_date=_parse_ts(row["logical_date"]),
            state=row["state"],
            run_type=row["run_type"],
            backfill_id=row["backfill_id"],
            clear_number=row["clear_number"] or 0,
            conf=conf if isinstance(conf, dict) else None,
        )

    def dag_runs(self, dag_id: str) -> list[RunResult]:
        """All runs of ``dag_id``, oldest logical date first (runs without one last)."""
        rows = self.query(
            "SELECT run_id, logical_date, state, run_type, backfill_id, clear_number, conf "
            "FROM dag_run WHERE dag_id = ? ORDER BY logical_date IS NULL, logical_date, id",
            (dag_id,),
        )
        return [self._run(r) for r in rows]

    def dag_run(self, dag_id: str, run_id: str) -> RunResult | None:
        row = self._query_one(
            "SELECT run_id, logical_date, state, run_type, backfill_id, clear_number, conf "
            "FROM dag_run WHERE dag_id = ? AND run_id = ?",
            (dag_id, run_id),
        )
        return self._run(row) if row else None

    def task_instances(self, dag_id: str, run_id: str) -> list[TaskInstanceResult]:
        """The task instances of one run, by task_id and map_index."""
        rows = self.query(
            "SELECT task_id, map_index, state, try_number, max_tries FROM task_instance "
            "WHERE dag_id = ? AND run_id = ? ORDER BY task_id, map_index",
            (dag_id, run_id),
        )
        return [
            TaskInstanceResult(
                r["task_id"], r["map_index"], r["state"], r["try_number"], r["max_tries"]
            )
            for r in rows
        ]

    def task_log(
        self, dag_id: str, run_id: str, task_id: str, try_number: int | None = None
    ) -> str:
        """The task's log file (latest attempt by default), '' if there is none."""
        folder = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        files = sorted(folder.glob("attempt=*.log"), key=lambda p: int(p.stem.split("=")[1]))
        if try_number is not None:
            files = [f for f in files if f.stem == f"attempt={try_number}"]
        return files[-1].read_text(encoding="utf-8", errors="replace") if files else ""

    def import_errors(self) -> list[tuple[str, str]]:
        """(filename, stacktrace) of every DAG file that failed to parse."""
        return [(r["filename"], r["stacktrace"]) for r in self.query("SELECT * FROM import_error")]

    def backfill_entries(self, backfill_id: int) -> list[BackfillEntry]:
        """Every date of a backfill, in order: its run, or why no run was created."""
        rows = self.query(
            "SELECT b.logical_date AS bdate, b.exception_reason, r.run_id, r.state "
            "FROM backfill_dag_run b LEFT JOIN dag_run r ON r.id = b.dag_run_id "
            "WHERE b.backfill_id = ? ORDER BY b.sort_ordinal",
            (backfill_id,),
        )
        return [
            BackfillEntry(_parse_ts(r["bdate"]), r["run_id"], r["state"], r["exception_reason"])
            for r in rows
        ]

    def backfill_runs(self, backfill_id: int) -> list[RunResult]:
        """The runs a backfill created or cleared, in the backfill's order."""
        rows = self.query(
            "SELECT r.run_id, r.logical_date, r.state, r.run_type, r.backfill_id, "
            "r.clear_number, r.conf FROM backfill_dag_run b JOIN dag_run r ON r.id = b.dag_run_id "
            "WHERE b.backfill_id = ? ORDER BY b.sort_ordinal",
            (backfill_id,),
        )
        return [self._run(r) for r in rows]

    def latest_backfill_id(self, dag_id: str) -> int | None:
        row = self._query_one("SELECT max(id) FROM backfill WHERE dag_id = ?", (dag_id,))
        return row[0] if row else None

    def describe_runs(self, dag_id: str, run_ids: Sequence[str]) -> str:
        """Human-readable states of some runs and their task instances (for error messages)."""
        out = []
        for run_id in run_ids:
            run = self.dag_run(dag_id, run_id)
            tis = ", ".join(
                f"{t.task_id}={t.state}(try {t.try_number})"
                for t in self.task_instances(dag_id, run_id)
            )
            out.append(f"  {run_id}: {run.state if run else 'missing'} [{tis}]")
        return "runs:\n" + "\n".join(out)

    # ---------------------------------------------------------------- DAG actions

    def wait_for_dag(self, dag_id: str, timeout: float = 60.0, reserialize: bool = False) -> None:
        """Wait until ``dag_id`` is parsed and serialized; raise at once on an import error."""
        if reserialize:
            self.airflow("dags", "reserialize")

        def ready() -> bool:
            errors = self.import_errors()
            if errors:
                raise StackError(
                    "DAG import errors:\n" + "\n".join(f"{f}:\n{st}" for f, st in errors)
                )
            row = self._query_one(
                "SELECT 1 FROM serialized_dag s JOIN dag d ON d.dag_id = s.dag_id "
                "WHERE s.dag_id = ? AND NOT d.is_stale",
                (dag_id,),
            )
            return row is not None

        log = "dag-processor" if "dag-processor" in self.components else "scheduler"
        self._wait(ready, timeout, f"DAG {dag_id!r} to be serialized from {self.dags_folder}", log)

    def unpause(self, dag_id: str, timeout: float = 60.0) -> None:
        """Wait for the DAG to be serialized, then unpause it (REST API, ~0.1 s vs ~4 s CLI)."""
        self.wait_for_dag(dag_id, timeout)
        self.api("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})

    def pause(self, dag_id: str) -> None:
        self.api("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": True})

    def wait_for_runs(
        self, dag_id: str, run_ids: Sequence[str], timeout: float = 120.0
    ) -> list[RunResult]:
        """Wait until every run in ``run_ids`` is success or failed; return them in order."""

        def done() -> list[RunResult] | None:
            runs = [self.dag_run(dag_id, r) for r in run_ids]
            if all(r is not None and r.state in TERMINAL_RUN_STATES for r in runs):
                return [r for r in runs if r is not None]
            return None

        return self._wait(
            done,
            timeout,
            f"runs of {dag_id} to finish",
            log="scheduler",
            describe=lambda: self.describe_runs(dag_id, run_ids),
        )

    def backfill(
        self,
        dag_id: str,
        from_date: date | datetime | str,
        to_date: date | datetime | str,
        reprocess_behavior: str = "none",
        max_active_runs: int | None = None,
        dag_run_conf: dict[str, Any] | None = None,
        timeout: float = 180.0,
        mark_complete: bool = True,
        pause_while_creating: bool = True,
    ) -> list[RunResult]:
        """``airflow backfill create`` and wait for its runs; return the runs it created/cleared.

        Dates skipped (already run, with ``reprocess_behavior="none"``) have no run: see
        :meth:`backfill_entries` of :attr:`last_backfill_id`. Only one backfill per DAG may
        be active, and the scheduler marks a backfill complete only every 30 s (hard-coded);
        with ``mark_complete`` (default) this method sets ``backfill.completed_at`` itself once
        all its runs are terminal (the scheduler's own criterion), so that the next backfill
        can start at once. Otherwise it waits for the scheduler to do it.

        ``pause_while_creating`` (default) pauses the DAG while the CLI creates the runs:
        when a write of ``backfill create`` hits SQLite's "database is locked", Airflow
        deletes the runs it had made, and a scheduler already working on them died with
        ObjectDeletedError (seen on a loaded machine). The scheduler ignores paused DAGs.
        """
        t0 = time.monotonic()
        before = self.latest_backfill_id(dag_id) or 0
        args = [
            "backfill", "create", "--dag-id", dag_id,
            "--from-date", _date_arg(from_date), "--to-date", _date_arg(to_date),
            "--reprocess-behavior", reprocess_behavior,
        ]  # fmt: skip
        if max_active_runs is not None:
            args += ["--max-active-runs", str(max_active_runs)]
        if dag_run_conf is not None:
            args += ["--dag-run-conf", json.dumps(dag_run_conf)]
        self._create_backfill(dag_id, args, before, t0 + timeout, pause_while_creating)
        backfill_id = self.latest_backfill_id(dag_id) or 0
        if backfill_id <= before:
            raise StackError(f"`airflow {' '.join(args)}` created no backfill")
        self.last_backfill_id = backfill_id
        # Normally one backfill; after a half-made one (see _create_backfill), its runs too.
        runs: dict[str, RunResult] = {}
        # Backfill ids are shared by every DAG: only this DAG's backfills in that range.
        made = self.query(
            "SELECT id FROM backfill WHERE dag_id = ? AND id > ? AND id <= ? ORDER BY id",
            (dag_id, before, backfill_id),
        )
        for (made_id,) in made:
            runs.update((r.run_id, r) for r in self.backfill_runs(made_id))
        run_ids = list(runs)
        remaining = max(1.0, timeout - (time.monotonic() - t0))
        self.wait_for_runs(dag_id, run_ids, remaining)
        if mark_complete:
            self.mark_backfill_complete(backfill_id)
        else:
            self._wait(
                lambda: (
                    self._query_one(
                        "SELECT 1 FROM backfill WHERE id = ? AND completed_at IS NOT NULL",
                        (backfill_id,),
                    )
                    is not None
                ),
                max(1.0, timeout - (time.monotonic() - t0)),
                f"the scheduler to mark backfill {backfill_id} complete",
                log="scheduler",
            )
        self.timings["last_backfill"] = time.monotonic() - t0
        fresh = [self.dag_run(dag_id, r) or runs[r] for r in run_ids]
        return sorted(fresh, key=lambda r: (r.logical_date is None, r.logical_date or 0))

    last_backfill_id: int | None = None

    def _create_backfill(
        self, dag_id: str, args: list[str], before: int, deadline: float, pause: bool
    ) -> None:
        """Run ``airflow backfill create`` until it succeeds, recovering from what a failed
        attempt leaves behind.

        A write of ``backfill create`` can fail with SQLite's "database is locked" after the
        backfill row and some of its runs were committed. Airflow then deletes that backfill
        (best effort): if the clean-up fails too, the half-made backfill stays active and
        every later attempt answers "Another backfill is running". A half-made backfill
        with runs is let finish (its runs need the DAG unpaused), closed, and the create is
        run again; the caller collects the runs of both. One with no runs is closed at once.
        Each failed attempt's output goes to ``stack-logs/backfill-create-<n>.log``.
        """
        attempt = 0
        while True:
            attempt += 1
            if pause:
                self.pause(dag_id)
            try:
                proc = self.airflow(*args, check=False)
            finally:
                if pause:
                    self.unpause(dag_id)
            if proc.returncode == 0:
                return
            text = proc.stdout + proc.stderr
            self.log_path(f"backfill-create-{attempt}").write_text(text, encoding="utf-8")
            half_made = self._half_made_backfill(dag_id, before)
            if time.monotonic() > deadline:
                raise _cli_error(args, proc, f" (attempt {attempt})")
            if half_made is not None:
                print(
                    f"[stack] `airflow backfill create` failed (attempt {attempt}, output in "
                    f"{self.log_path(f'backfill-create-{attempt}')}) and left backfill "
                    f"{half_made} half made: letting its runs finish, then creating again",
                    file=sys.stderr,
                    flush=True,
                )
                run_ids = [r.run_id for r in self.backfill_runs(half_made)]
                self.wait_for_runs(dag_id, run_ids, max(1.0, deadline - time.monotonic()))
                self.mark_backfill_complete(half_made)
            elif "Another backfill is running" in text:
                pass  # an earlier backfill is still active: wait for it
            elif "database is locked" not in text or attempt >= 8:
                raise _cli_error(args, proc, f" (attempt {attempt})")
            time.sleep(min(0.5 * attempt, 3.0))

    def _half_made_backfill(self, dag_id: str, after_id: int) -> int | None:
        """An active backfill newer than ``after_id`` (only a failed attempt made it). One
        with no runs is marked complete here, as the scheduler does after 2 minutes."""
        self._complete_orphan_backfills(dag_id, after_id)
        row = self._query_one(
            "SELECT max(id) FROM backfill WHERE dag_id = ? AND id > ? AND completed_at IS NULL",
            (dag_id, after_id),
        )
        return row[0] if row and row[0] is not None else None

    def _complete_orphan_backfills(self, dag_id: str, after_id: int) -> None:
        """Mark backfills newer than ``after_id`` that got no run rows complete (as the
        scheduler does after 2 minutes)."""
        self._write(
            "UPDATE backfill SET completed_at = ? WHERE dag_id = ? AND id > ? "
            "AND completed_at IS NULL AND NOT EXISTS "
            "(SELECT 1 FROM backfill_dag_run b WHERE b.backfill_id = backfill.id)",
            (NOW, dag_id, after_id),
        )

    def _write(self, sql: str, params: Sequence[Any]) -> None:
        """One write to the metadata DB (``?`` placeholders; ``NOW`` for the current time)."""
        if self.metadata_dsn is not None:
            values = [datetime.now(timezone.utc) if p is NOW else p for p in params]
            with psycopg.connect(self.metadata_dsn) as conn:
                conn.execute(sql.replace("?", "%s"), values)
            return
        values = [_now_db() if p is NOW else p for p in params]
        with closing(sqlite3.connect(self.db_path, timeout=30)) as lite, lite:
            lite.execute(sql, values)

    def mark_backfill_complete(self, backfill_id: int) -> None:
        """What SchedulerJobRunner._mark_backfills_complete does, without its 30 s timer."""
        self._write(
            "UPDATE backfill SET completed_at = ? WHERE id = ? AND completed_at IS NULL "
            "AND NOT EXISTS (SELECT 1 FROM dag_run WHERE backfill_id = ? "
            "AND state IN ('running', 'queued'))",
            (NOW, backfill_id, backfill_id),
        )

    def trigger(
        self,
        dag_id: str,
        logical_date: date | datetime | str | None = None,
        conf: dict[str, Any] | None = None,
        run_id: str | None = None,
        wait: bool = True,
        timeout: float = 120.0,
    ) -> RunResult:
        """``airflow dags trigger`` (no logical date unless given); wait for a terminal state."""
        args = ["dags", "trigger", dag_id, "-o", "json"]
        if logical_date is not None:
            args += ["--logical-date", _date_arg(logical_date)]
        if conf is not None:
            args += ["--conf", json.dumps(conf)]
        if run_id is not None:
            args += ["--run-id", run_id]
        out = self.airflow_retrying(*args).stdout
        if run_id is None:
            run_id = run_id_from_trigger_output(out)
        if not wait:
            run = self.dag_run(dag_id, run_id)
            if run is None:
                raise StackError(f"triggered run {run_id} of {dag_id} not found")
            return run
        return self.wait_for_runs(dag_id, [run_id], timeout)[0]


NOW = object()  # a parameter of AirflowStack._write: the current time


class _Row(tuple[Any, ...]):
    """A row of a PostgreSQL query addressable like sqlite3.Row: ``row[0]``, ``row["name"]``."""

    names: dict[str, int]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return super().__getitem__(self.names[key])
        return super().__getitem__(key)


def _name_and_index_rows(cursor: psycopg.Cursor[Any]) -> Callable[[Sequence[Any]], _Row]:
    names = {c.name: i for i, c in enumerate(cursor.description or ())}

    def make(values: Sequence[Any]) -> _Row:
        row = _Row(values)
        row.names = names
        return row

    return make


def _now_db() -> str:
    """Now, in the format Airflow's UtcDateTime stores in SQLite."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")


def _cli_error(
    args: Sequence[str], proc: subprocess.CompletedProcess[str], note: str = ""
) -> StackError:
    return StackError(
        f"`airflow {' '.join(args)}` exited {proc.returncode}{note}\n"
        f"--- stdout:\n{proc.stdout[-3000:]}\n--- stderr:\n{proc.stderr[-3000:]}"
    )


def run_id_from_trigger_output(out: str) -> str:
    """The run id from ``airflow dags trigger -o json`` output: log lines, then a JSON list
    with one dict whose key is ``dag_run_id`` (not ``run_id``)."""
    for line in reversed(out.splitlines()):
        if line.startswith("[{"):
            with suppress(ValueError):
                data = json.loads(line)
                return str(data[0].get("dag_run_id") or data[0]["run_id"])
    raise StackError(f"no run id in `airflow dags trigger` output:\n{out[-2000:]}")


class StackOptions(TypedDict, total=False):
    """The keyword options of :class:`AirflowStack`, passed through by :func:`airflow_stack`."""

    dag_processor: bool
    triggerer: bool
    db_template: bool
    metadata_dsn: str | None
    celery_workers: Sequence[str]


@contextmanager
def airflow_stack(
    home: Path,
    dags_folder: Path,
    extra_env: dict[str, str] | None = None,
    port: int | None = None,
    *,
    start_timeout: float = 120.0,
    **options: Unpack[StackOptions],
) -> Iterator[AirflowStack]:
    """Start a stack on ``home`` / ``dags_folder``; kill all its processes on exit.

    ``options``: those of :class:`AirflowStack`, every one of them.
    """
    stack = AirflowStack(home, dags_folder, extra_env, port, **options)
    try:
        stack.start(start_timeout)
        yield stack
    finally:
        stack.stop()
