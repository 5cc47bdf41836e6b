"""The plumbing of `python3 dev.py demo` (devtools/demo.py keeps the narrated steps).

Its terminal output, reads of the job database, set-up (database, accounting service),
the Airflow workers and REST calls, the processes it must leave none of, Ctrl-C while it
cleans up, and its work folder.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

import psycopg
from psycopg import sql
from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from devtools import airflow_env, invariants
from devtools.airflow_env import DAGS_FOLDER, ROOT, connection_env
from devtools.workers import dags_test, kill_group, private_airflow_env

DAG_ID = "finalize_invoices"
DB_PREFIX = "idem_demo_"


class DemoFailure(Exception):
    """A step did not do what it claims."""


def rel(path: Path) -> str:
    """``path`` relative to the current folder when it is below it (shorter to read)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# -- processes ------------------------------------------------------------------------


class Attempt(NamedTuple):
    """One row of idempotency.job_run_attempts (job without the DAG id prefix)."""

    attempt_id: int
    job: str
    outcome: str
    triggered_by: str
    run_key: str
    run_id: str | None
    pid: int
    started_at: dt.datetime


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


# -- the rig ---------------------------------------------------------------------------


@dataclass
class DemoRig:
    """What the narrated steps stand on: output, the job database, set-up and Airflow."""

    args: argparse.Namespace
    console: Console
    workdir: Path
    dsn: str = ""
    db_name: str = ""
    server_note: str = ""
    server_source: str = ""
    service: Any = None
    smtp: Any = None  # the local SMTP server the finance summary emails go to
    stack: Any = None
    conn_env: dict[str, str] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    checks: int = 0

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    # ---------------------------------------------------------------- output

    def say(self, text: str) -> None:
        self.console.print(
            Padding(Text.from_markup(text), (0, 0, 0, 2), expand=False), highlight=False
        )

    def section(self, number: int | str, title: str, intro: str = "") -> None:
        self.console.print()
        self.console.rule(f"[bold cyan]Step {number} · {title}", align="left", style="cyan")
        if intro:
            self.say(f"[dim]{intro}[/dim]")

    def check(self, ok: bool, claim: str, detail: Callable[[], str] | str = "") -> None:
        """Print ``claim`` as passed, or stop the demo with it as the failure."""
        if not ok:
            text = detail() if callable(detail) else detail
            raise DemoFailure(f"{claim}\n{text}".strip())
        self.checks += 1
        self.console.print(f"  [green]✓[/green] {claim}", highlight=False, soft_wrap=True)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
        for i, column in enumerate(columns):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*(_cell(v) for v in row))
        self.console.print(table)

    def timed(self, name: str) -> contextlib.AbstractContextManager[None]:
        return _timer(self.timings, name)

    # ---------------------------------------------------------------- database

    def rows(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn) as conn:
            return conn.execute(query, params).fetchall()

    def value(self, query: str, params: Any = None) -> Any:
        return self.rows(query, params)[0][0]

    def date_state(self, day: dt.date) -> dict[str, int]:
        """Counts of one business date in every place the job writes to."""
        return invariants.date_counts(self.dsn, day)

    def converged(self, day: dt.date) -> tuple[bool, str]:
        """Invoices = orders, exactly one remote invoice per order, every ledger row confirmed."""
        return not invariants.not_converged(self.dsn, [day]), f"{day}: {self.date_state(day)}"

    def fingerprint(self, days: Sequence[dt.date]) -> tuple[Any, ...]:
        """A digest of everything a no-op must leave alone (rows, statuses, rebuild times)."""
        return invariants.fingerprint(self.dsn, days)

    def details(self, day: dt.date, job: str) -> dict[str, Any]:
        rows = self.rows(
            "SELECT details FROM idempotency.job_runs WHERE job_name = %s AND run_key = %s",
            (f"{DAG_ID}.{job}", day.isoformat()),
        )
        return dict(rows[0][0]) if rows else {}

    def attempts(self, run_keys: Sequence[dt.date], after_id: int = 0) -> list[Attempt]:
        """The attempts recorded on ``run_keys`` after ``after_id``, in order."""
        rows = self.rows(
            "SELECT attempt_id, split_part(job_name, '.', 2), outcome, triggered_by, run_key,"
            " run_id, pid, started_at FROM idempotency.job_run_attempts"
            " WHERE run_key = ANY(%s) AND attempt_id > %s ORDER BY attempt_id",
            ([d.isoformat() for d in run_keys], after_id),
        )
        return [Attempt(*row) for row in rows]

    def last_attempt_id(self) -> int:
        return int(
            self.value("SELECT coalesce(max(attempt_id), 0) FROM idempotency.job_run_attempts")
        )

    def requests(self) -> int:
        return int(self.service.stats()["requests"])

    # ---------------------------------------------------------------- set-up

    def setup_database(self, stack: contextlib.ExitStack) -> None:
        from devtools.postgres import find_server

        server = find_server()
        stack.callback(self._stop_server, server)
        self.server_source = server.source
        self.server_note = {
            "dsn": "the server from IDEMPOTENCY_PG_DSN",
            "local": "the local server on 127.0.0.1:5432",
            "embedded": f"an embedded server (data in {rel(ROOT / '.pgdata')}/)",
        }[server.source]
        self.drop_previous_databases(server)
        self.db_name = f"{DB_PREFIX}{dt.datetime.now():%Y%m%d_%H%M%S}_{os.getpid()}"
        (self.workdir / "database").write_text(self.db_name + "\n")
        server.create_database(name=self.db_name)
        self.dsn = server.dsn(self.db_name)
        if not self.args.keep:
            stack.callback(server.drop_database, self.db_name)
        # Held until the end: a concurrent demo's clean-up never drops a database in use.
        stack.enter_context(psycopg.connect(self.dsn))

    def drop_previous_databases(self, server: Any) -> None:
        recorded_file = self.workdir / "database"
        recorded = recorded_file.read_text().strip() if recorded_file.exists() else None
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            names = [
                n
                for (n,) in conn.execute(
                    "SELECT datname FROM pg_database WHERE starts_with(datname, %s)", (DB_PREFIX,)
                )
            ]
            dropped = []
            for name in names:
                # This work folder's previous database, even if a leftover session holds it;
                # any other demo database only when nobody uses it (another demo may run).
                force = sql.SQL(" WITH (FORCE)") if name == recorded else sql.SQL("")
                stmt = sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)) + force
                try:
                    conn.execute(stmt)
                    dropped.append(name)
                except psycopg.errors.ObjectInUse:
                    pass
        if dropped:
            self.say(f"[dim]dropped {len(dropped)} previous demo database(s)[/dim]")

    @staticmethod
    def _stop_server(server: Any) -> None:
        server.close()

    def start_service(self, stack: contextlib.ExitStack) -> None:
        from devtools.accounting import run_accounting_service

        log = self.logs / "accounting-service.log"
        stack.callback(lambda: log.write_text(self.service.stderr_text() if self.service else ""))
        self.service = stack.enter_context(run_accounting_service(self.dsn))
        # batch_size: the ledger claims and confirms 50 invoices per statement (default 500),
        # so that the crash of step 5 leaves confirmed, pending and unclaimed invoices.
        self.conn_env = connection_env(self.dsn, self.service.url, timeout=10, batch_size=50)
        self.start_mail_and_files(stack)
        self.write_env_file()

    @property
    def exports(self) -> Path:
        """Where the example writes each date's export file (the invoice_exports connection)."""
        return self.workdir / "exports"

    def start_mail_and_files(self, stack: contextlib.ExitStack) -> None:
        """A local SMTP server for the finance summary emails (it counts what it delivers) and
        the export files' folder: the finance_smtp and invoice_exports connections."""
        from devtools.smtp_server import SmtpServer, smtp_connection_env

        self.smtp = SmtpServer(self.workdir / "mail")
        self.smtp.start()
        stack.callback(self.smtp.kill)
        self.exports.mkdir(parents=True, exist_ok=True)
        self.conn_env.update(
            smtp_connection_env(self.smtp, "finance_smtp", "invoicing@example.com")
        )
        folder = {"conn_type": "fs", "extra": {"path": str(self.exports)}}
        self.conn_env["AIRFLOW_CONN_INVOICE_EXPORTS"] = json.dumps(folder)

    def summary_mails(self, day: dt.date) -> int:
        """How many finance summary emails of ``day`` the SMTP server delivered."""
        key = f"finalize_invoices:{day.isoformat()}:finance_summary"
        return int(self.smtp.deliveries_by_key()[key])

    def export_file(self, day: dt.date) -> tuple[int, int, bytes] | None:
        """The export file of ``day``: (mtime in ns, inode, content), or None if absent."""
        path = self.exports / "invoices" / f"{day.isoformat()}.csv"
        if not path.exists():
            return None
        info = path.stat()
        return info.st_mtime_ns, info.st_ino, path.read_bytes()

    def write_env_file(self) -> None:
        """``.demo/env.sh``: what a shell needs to look at the demo's Airflow and database."""
        home = self.workdir / "airflow"
        values = {
            **airflow_env.configure(home, {}),
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(DAGS_FOLDER)]),
            "AIRFLOW_IDEMPOTENCY_DSN": self.dsn,
            **self.conn_env,
        }
        lines = [f"export {k}={shlex.quote(v)}" for k, v in values.items()]
        (self.workdir / "env.sh").write_text("\n".join(lines) + "\n")

    # ---------------------------------------------------------------- Airflow helpers

    def start_dags_test(
        self,
        name: str,
        *,
        logical_date: str | None = None,
        conf: dict[str, Any] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> Worker:
        """``airflow dags test finalize_invoices`` with its own Airflow home (a copy of a
        migrated metadata DB): several can run at once, sharing only the job database."""
        from devtools.airflow_stack import migrated_db_template

        home = self.workdir / "workers" / name
        env = private_airflow_env(migrated_db_template(), home, self.conn_env)
        env.update(extra_env or {})
        log = self.logs / f"dags-test-{name}.log"
        with open(log, "w") as out:
            proc = dags_test(env, DAG_ID, logical_date, conf, cwd=home, output=out)
        worker = Worker(name, proc, log)
        self.workers.append(worker)
        return worker

    def api(self, method: str, path: str, body: Any = None, ok_conflict: bool = False) -> Any:
        """The REST API, again on a 5xx (SQLite's "database is locked" comes back as one)."""
        from devtools.airflow_stack import StackError

        for attempt in range(1, 7):
            try:
                return self.stack.api(method, path, body)
            except StackError as exc:
                if ok_conflict and "-> 409" in str(exc):
                    return None  # an earlier try did it after all
                if "-> 5" not in str(exc) or attempt == 6:
                    raise
                time.sleep(attempt)
        return None

    def trigger(self, logical_date: str | None = None, conf: dict[str, Any] | None = None) -> Any:
        """Trigger a run through the REST API (what the UI's Trigger button does; ~10 s less
        than `airflow dags trigger`, which imports all of Airflow first) and wait for it."""
        run_id = f"manual__{dt.datetime.now(dt.timezone.utc).isoformat()}"
        body = {"dag_run_id": run_id, "logical_date": logical_date, "conf": conf or {}}
        self.api("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", body, ok_conflict=True)
        return self.stack.wait_for_runs(DAG_ID, [run_id], timeout=600)[0]

    def kill_workers(self) -> None:
        for worker in self.workers:
            worker.kill()

    def task_states(self, run_id: str) -> str:
        return ", ".join(
            f"{t.task_id} {t.state}" for t in self.stack.task_instances(DAG_ID, run_id)
        )

    def run_failed(self, run_ids: Sequence[str]) -> Callable[[], str]:
        def describe() -> str:
            return (
                f"{self.stack.describe_runs(DAG_ID, run_ids)}\n"
                f"task logs: {rel(self.stack.home / 'logs' / f'dag_id={DAG_ID}')}/\n"
                f"scheduler log: {rel(self.stack.log_path('scheduler'))}"
            )

        return describe


def cleaning_begins() -> None:
    global _cleaning
    _cleaning = True


@contextlib.contextmanager
def _timer(timings: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    finally:
        timings[name] = time.monotonic() - t0


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if value is None:
        return "-"
    return str(value)


def prepare_workdir(workdir: Path) -> IO[str]:
    """Lock the work folder (one demo at a time per folder) and empty it; return the lock."""
    if workdir.is_dir() and any(workdir.iterdir()) and not (workdir / ".lock").exists():
        raise SystemExit(
            f"{workdir} is not empty and is not a demo work folder (no .lock file): "
            "refusing to wipe it; pass an empty or new folder as --workdir"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    lock = open(workdir / ".lock", "w")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(
            f"another demo is running in {rel(workdir)}/; wait for it, or pass --workdir"
        ) from None
    for entry in workdir.iterdir():
        if entry.name in (".lock", "database"):  # "database": dropped once the server is up
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    (workdir / "logs").mkdir()
    return lock
