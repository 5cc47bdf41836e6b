"""`python3 dev.py demo`: the invoice-finalization DAG through REAL Airflow, step by step.

What it runs, against a fresh PostgreSQL database and the accounting HTTP service:

1. seed orders, then the nightly run of business date 2026-10-01 (fired 2026-10-02 01:00);
2. the same date triggered again by hand (conf run_key): a no-op;
3. two runs of one date at once (two ``airflow dags test`` processes): the lock lets one
   work, the other waits and then no-ops;
4. ``airflow backfill create`` over a week, then the same week again with
   ``--reprocess-behavior completed``: all no-ops;
5. a worker SIGKILLed in the middle of the export, then the rerun;
6. the final bookkeeping: job_runs, attempts, ledger, the accounting service's invoices.

Each step checks what it claims and the demo exits 1 at the first check that fails, so it
is also an end-to-end test (tests/test_demo.py runs ``--quick``). Airflow's own output goes
to log files under the work folder (``.demo/`` by default, wiped at start); the terminal
shows a summary. The scheduler, api-server and dag-processor, the accounting service, the
``dags test`` workers and an embedded PostgreSQL are all stopped at the end, also after a
failure or Ctrl-C. AIRFLOW* variables of the calling shell are ignored.

    python3 dev.py demo [--orders N] [--quick] [--keep] [--workdir DIR]
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
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple
from urllib.parse import urlsplit

import psycopg
from psycopg import sql
from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from devtools import airflow_env
from devtools.airflow_env import DAGS_FOLDER, ROOT

if str(DAGS_FOLDER) not in sys.path:  # `invoicing` lives in dags/ (dev.py puts it on the path)
    sys.path.insert(0, str(DAGS_FOLDER))

DAG_ID = "finalize_invoices"
JOBS = ("create_invoices", "rebuild_totals", "export_invoices")
DB_PREFIX = "idem_demo_"
SEED = 42
FIRST_DATE = dt.date(2026, 10, 1)
RACE_DATE = dt.date(2026, 10, 9)
CRASH_DATE = dt.date(2026, 10, 10)
SLEEP_WHILE_LOCKED = 20  # seconds the winner of the race holds the lock (fault point)
OUTCOMES = ("completed", "noop", "lock_held", "running", "failed", "lock_lost", "dry_run")


class DemoFailure(Exception):
    """A step did not do what it claims."""


@dataclass(frozen=True)
class Plan:
    """The numbers of one demo run."""

    first_orders: int
    week: tuple[dt.date, ...]
    week_orders: int
    race_orders: int
    crash_orders: int
    crash_at: int

    @classmethod
    def build(cls, quick: bool, orders: int | None) -> Plan:
        if quick:
            return cls(orders or 200, _days(dt.date(2026, 10, 2), 3), 30, 40, 120, 70)
        return cls(orders or 1287, _days(dt.date(2026, 10, 2), 7), 200, 200, 300, 120)

    def seeding(self) -> list[tuple[str, dt.date, dt.date, int]]:
        return [
            ("steps 1-2: nightly run, manual rerun", FIRST_DATE, FIRST_DATE, self.first_orders),
            ("step 4: backfill", self.week[0], self.week[-1], self.week_orders),
            ("step 3: two runs at once", RACE_DATE, RACE_DATE, self.race_orders),
            ("step 5: crash mid-export", CRASH_DATE, CRASH_DATE, self.crash_orders),
        ]

    @property
    def all_dates(self) -> list[dt.date]:
        return [FIRST_DATE, *self.week, RACE_DATE, CRASH_DATE]

    @property
    def total_orders(self) -> int:
        return sum(n * ((b - a).days + 1) for _, a, b, n in self.seeding())


def _days(start: dt.date, count: int) -> tuple[dt.date, ...]:
    return tuple(start + dt.timedelta(days=i) for i in range(count))


def fire_time(business_date: dt.date) -> str:
    """When the nightly run of ``business_date`` fires (D+1 01:00 UTC): its logical date."""
    fired = dt.datetime.combine(business_date + dt.timedelta(days=1), dt.time(1), dt.timezone.utc)
    return fired.isoformat()


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
    proc: subprocess.Popen[bytes]
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
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

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


def leftover_processes(home_prefix: Path, db_name: str) -> list[str]:
    """Live processes (other than this one and its parents) that belong to this demo: an
    AIRFLOW_HOME under the work folder, or the demo database in their command line or
    environment (the accounting service, Airflow processes, PostgreSQL backends)."""
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


def _on_signal(signum: int, _frame: Any) -> None:
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


# -- the demo -------------------------------------------------------------------------


@dataclass
class Demo:
    args: argparse.Namespace
    plan: Plan
    console: Console
    workdir: Path
    dsn: str = ""
    db_name: str = ""
    server_note: str = ""
    server_source: str = ""
    service: Any = None
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
        row = self.rows(
            """
            SELECT
              (SELECT count(*) FROM orders WHERE shipped_on = %(d)s::date),
              (SELECT count(*) FROM invoices WHERE business_date = %(d)s::date),
              (SELECT count(*) FROM orders WHERE shipped_on = %(d)s::date AND invoiced_at IS NULL),
              (SELECT coalesce(sum(invoice_count), 0) FROM daily_invoice_totals
                WHERE business_date = %(d)s::date),
              (SELECT count(*) FROM idempotency.outbound_ledger
                WHERE run_key = %(k)s AND status = 'succeeded'),
              (SELECT count(*) FROM idempotency.outbound_ledger
                WHERE run_key = %(k)s AND status = 'pending'),
              (SELECT count(*) FROM idempotency.outbound_ledger
                WHERE run_key = %(k)s AND status = 'failed'),
              (SELECT count(*) FROM accounting.invoices WHERE invoice->>'business_date' = %(k)s),
              (SELECT count(DISTINCT invoice->>'order_id') FROM accounting.invoices
                WHERE invoice->>'business_date' = %(k)s)
            """,
            {"d": day.isoformat(), "k": day.isoformat()},
        )[0]
        keys = (
            "orders", "invoices", "uninvoiced", "totals", "ledger_succeeded", "ledger_pending",
            "ledger_failed", "remote", "remote_orders",
        )  # fmt: skip
        return dict(zip(keys, (int(v) for v in row), strict=True))

    def converged(self, day: dt.date) -> tuple[bool, str]:
        """Invoices = orders, exactly one remote invoice per order, every ledger row confirmed."""
        s = self.date_state(day)
        n = s["orders"]
        ok = (
            n > 0
            and s["invoices"] == n
            and s["uninvoiced"] == 0
            and s["totals"] == n
            and s["ledger_succeeded"] == n
            and s["ledger_pending"] == s["ledger_failed"] == 0
            and s["remote"] == s["remote_orders"] == n
        )
        return ok, f"{day}: {s}"

    def fingerprint(self, days: Sequence[dt.date]) -> tuple[Any, ...]:
        """A digest of everything a no-op must leave alone (rows, statuses, rebuild times)."""
        keys = [d.isoformat() for d in days]
        return self.rows(
            """
            SELECT
              (SELECT md5(coalesce(string_agg(invoice_number || ':' || order_id || ':'
                 || amount_cents, ',' ORDER BY invoice_number), ''))
                 FROM invoices WHERE business_date = ANY(%(d)s::date[])),
              (SELECT md5(coalesce(string_agg(business_date || ':' || store_id || ':'
                 || invoice_count || ':' || rebuilt_at, ',' ORDER BY business_date, store_id), ''))
                 FROM daily_invoice_totals WHERE business_date = ANY(%(d)s::date[])),
              (SELECT md5(coalesce(string_agg(idempotency_key || ':' || status || ':'
                 || coalesce(remote_reference, '') || ':' || call_count, ','
                 ORDER BY idempotency_key), ''))
                 FROM idempotency.outbound_ledger WHERE run_key = ANY(%(k)s)),
              (SELECT count(*) FROM accounting.invoices),
              (SELECT coalesce(max(id), 0) FROM accounting.invoices)
            """,
            {"d": keys, "k": keys},
        )[0]

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
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.db_name)))
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
        server.stop()

    def start_service(self, stack: contextlib.ExitStack) -> None:
        from devtools.accounting import run_accounting_service

        log = self.logs / "accounting-service.log"
        stack.callback(lambda: log.write_text(self.service.stderr_text() if self.service else ""))
        self.service = stack.enter_context(run_accounting_service(self.dsn))
        url = urlsplit(self.service.url)
        # batch_size: the ledger claims and confirms 50 invoices per statement (default 500),
        # so that the crash of step 5 leaves confirmed, pending and unclaimed invoices.
        options = {"timeout": 10, "backoff_initial": 0.05, "backoff_max": 0.5, "batch_size": 50}
        accounting = {"conn_type": "http", "host": url.hostname, "port": url.port, "extra": options}
        self.conn_env = {
            "AIRFLOW_CONN_IDEMPOTENCY_DEFAULT": airflow_env.airflow_connection_json(self.dsn),
            "AIRFLOW_CONN_ACCOUNTING_API": json.dumps(accounting),
        }
        self.write_env_file()

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

    def seed(self) -> None:
        from invoicing.seed import seed_orders

        rows = []
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for purpose, start, end, per_day in self.plan.seeding():
                created = seed_orders(conn, start, end, per_day, SEED)
                span = str(start) if start == end else f"{start} .. {end}"
                rows.append((span, per_day, created, purpose))
        self.table(
            f"Orders seeded (deterministic, seed {SEED})",
            ["business date", "orders/day", "orders", "used in"],
            rows,
        )
        total = self.value("SELECT count(*) FROM orders")
        self.check(
            total == self.plan.total_orders, f"{total:,} orders in the job database", str(total)
        )

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
        home.mkdir(parents=True)
        shutil.copyfile(migrated_db_template(), home / "airflow.db")
        env = dict(os.environ)
        airflow_env.configure(home, env)
        env["AIRFLOW__CORE__DAGS_FOLDER"] = str(DAGS_FOLDER)
        env["AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH"] = str(home / "bundles")
        env.update(self.conn_env)
        env.update(extra_env or {})
        cmd = [sys.executable, "-m", "airflow", "dags", "test", DAG_ID]
        if logical_date:
            cmd.append(logical_date)
        if conf is not None:
            cmd += ["-c", json.dumps(conf)]
        log = self.logs / f"dags-test-{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=home,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
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

    # ---------------------------------------------------------------- steps

    def step_nightly_run(self) -> None:
        day = FIRST_DATE
        self.section(
            1,
            f"The nightly run of business date {day}",
            f"Scheduled 0 1 * * *: the run fired at {fire_time(day)} (its logical date) "
            f"processes the previous day, {day}. Triggered through the REST API with that "
            "logical date, as the scheduler would have created it.",
        )
        with self.console.status("Airflow runs finalize_invoices ..."), self.timed("step 1"):
            run = self.trigger(logical_date=fire_time(day))
        self.check(
            run.state == "success",
            f"Airflow run {run.run_id} finished: {run.state}",
            self.run_failed([run.run_id]),
        )
        create = self.details(day, "create_invoices")
        totals = self.details(day, "rebuild_totals")
        export = self.details(day, "export_invoices")
        state = self.date_state(day)
        self.table(
            f"Business date {day}",
            ["", "count"],
            [
                ("orders shipped", state["orders"]),
                ("invoices created (create_invoices)", create.get("invoices_created")),
                ("daily totals rows (rebuild_totals)", totals.get("totals_rows")),
                ("exports sent (export_invoices)", export.get("exports_sent")),
                ("exports skipped, already confirmed", export.get("exports_skipped_existing")),
                ("exports failed / pending", _pair(export, "exports_failed", "exports_pending")),
                ("invoices in the accounting service", state["remote"]),
            ],
        )
        self.say(f"[dim]tasks: {self.task_states(run.run_id)}[/dim]")
        n = state["orders"]
        self.check(
            create.get("invoices_created") == n == export.get("exports_sent"),
            f"{n:,} orders -> {n:,} invoices created -> {n:,} exports sent",
            json.dumps({"create": create, "export": export}),
        )
        ok, detail = self.converged(day)
        self.check(ok, "exactly one remote invoice per order, every ledger row confirmed", detail)

    def step_manual_rerun(self) -> None:
        day = FIRST_DATE
        self.section(
            2,
            f"The same date triggered again by hand: {{'run_key': '{day}'}}",
            "A manual trigger has no logical date; the conf names the business date.",
        )
        before, requests, marker = self.fingerprint([day]), self.requests(), self.last_attempt_id()
        with self.console.status("Airflow runs finalize_invoices ..."), self.timed("step 2"):
            run = self.trigger(conf={"run_key": day.isoformat()})
        self.check(
            run.state == "success",
            f"Airflow run {run.run_id} finished: {run.state}",
            self.run_failed([run.run_id]),
        )
        attempts = self.attempts([day], marker)
        self.table(
            "Attempts recorded by this run",
            ["job", "outcome", "triggered by", "run key"],
            [(a.job, a.outcome, a.triggered_by, a.run_key) for a in attempts],
        )
        self.say(f"[dim]tasks: {self.task_states(run.run_id)}[/dim]")
        self.check(
            sorted((a.job, a.outcome) for a in attempts) == sorted((j, "noop") for j in JOBS),
            "every job recorded a noop attempt: the date was already completed",
            str(attempts),
        )
        sent = self.requests() - requests
        self.check(sent == 0, "0 requests to the accounting service", f"{sent} requests")
        self.check(
            self.fingerprint([day]) == before,
            "invoices, daily totals and ledger unchanged (not even rewritten)",
        )

    def step_two_at_once(self) -> None:
        day = RACE_DATE
        self.section(
            3,
            f"Two runs of business date {day} at the same time",
            "Two `airflow dags test` processes (own metadata DBs, one job database) start "
            f"together; whoever gets the advisory lock works (held {SLEEP_WHILE_LOCKED} s by a "
            "fault point, to make the overlap visible), the other records lock_held, is "
            "rescheduled (30 s) and then finds the date completed.",
        )
        conf = {"run_key": day.isoformat()}
        slow = {"AIRFLOW_IDEMPOTENCY_SLEEP_AT": f"runner.after_started={SLEEP_WHILE_LOCKED}"}
        with self.console.status("two workers run the same date ..."), self.timed("step 3"):
            workers = [self.start_dags_test(n, conf=conf, extra_env=slow) for n in ("A", "B")]
            codes = [w.wait(600) for w in workers]
        for worker, code in zip(workers, codes, strict=True):
            self.say(f"[dim]worker {worker.name}: exit {code}, log {rel(worker.log)}[/dim]")
        attempts = self.attempts([day])
        # `dags test` runs the tasks in its own process: the attempt's pid names the worker.
        owner = {w.proc.pid: w.name for w in workers}

        self.table(
            f"Attempts on run key {day}, in order",
            ["job", "outcome", "worker", "at"],
            [
                (a.job, a.outcome, owner.get(a.pid, "?"), f"{a.started_at:%H:%M:%S}")
                for a in attempts
            ],
        )
        self.check(codes == [0, 0], "both Airflow runs succeeded", f"exit codes {codes}")
        held = [a for a in attempts if a.outcome == "lock_held"]
        self.check(
            bool(held),
            f"{len(held)} lock_held attempt(s): the second run was blocked by the lock",
            lambda: f"attempts: {attempts}",
        )
        completed = sorted(a.job for a in attempts if a.outcome == "completed")
        self.check(
            completed == sorted(JOBS),
            "each job completed exactly once; the blocked run then no-op'ed",
            str(attempts),
        )
        ok, detail = self.converged(day)
        state = self.date_state(day)
        self.check(
            ok,
            f"{state['remote']:,} remote invoices for {state['orders']:,} orders: "
            "exactly one per order",
            detail,
        )

    def backfill(self, reprocess_behavior: str) -> list[Any]:
        """``airflow backfill create`` over the week through the stack helper; return the run
        of every date of the week, once all are finished.

        The helper pauses the DAG while the CLI creates the runs, runs the CLI again when a
        write failed with SQLite's "database is locked" (frequent on a busy machine), lets a
        backfill that such a failure left half made finish first, and marks the backfill
        complete itself (the scheduler does it only every 30 s) so the next one can start.
        """
        week = self.plan.week
        fires = [fire_time(d) for d in week]
        before = self.stack.latest_backfill_id(DAG_ID) or 0
        runs = self.stack.backfill(
            DAG_ID, fires[0], fires[-1], reprocess_behavior=reprocess_behavior, timeout=900
        )
        latest = self.stack.latest_backfill_id(DAG_ID) or 0
        if latest - before > 1:
            self.say(
                f'[yellow]note[/]: `airflow backfill create` hit SQLite\'s "database is locked" '
                f"and was run again ({latest - before} backfills created)"
            )
        got = [r.logical_date.isoformat() if r.logical_date else None for r in runs]
        if got != fires:
            raise DemoFailure(f"backfill runs for {got}, expected one per fire time {fires}")
        return runs

    def step_backfill(self) -> None:
        week = self.plan.week
        start, end = fire_time(week[0]), fire_time(week[-1])
        self.section(
            4,
            f"A backfill of {week[0]} .. {week[-1]}, then the same range again",
            f"airflow backfill create --dag-id {DAG_ID} --from-date {start} --to-date {end}",
        )
        requests = self.requests()
        with self.console.status(f"backfill of {len(week)} dates ..."), self.timed("step 4a"):
            first = self.backfill("none")
        self.check(
            [r.state for r in first] == ["success"] * len(week),
            f"{len(first)} backfill runs, all success",
            self.run_failed([r.run_id for r in first]),
        )
        rows = []
        for run, day in zip(first, week, strict=True):
            s, export = self.date_state(day), self.details(day, "export_invoices")
            logical = f"{run.logical_date:%Y-%m-%d %H:%M}" if run.logical_date else "-"
            sent = export.get("exports_sent")
            rows.append((day, logical, run.state, s["orders"], s["invoices"], sent, s["remote"]))
        self.table(
            "First pass",
            ["business date", "logical date", "run", "orders", "invoices", "sent", "remote"],
            rows,
        )
        for day in week:
            ok, detail = self.converged(day)
            if not ok:
                self.check(False, "every date converged", detail)
        self.check(True, "every date: one invoice and one remote invoice per order")
        first_requests = self.requests() - requests

        before, requests, marker = self.fingerprint(week), self.requests(), self.last_attempt_id()
        self.say("The same range again, with [bold]--reprocess-behavior completed[/]:")
        status = self.console.status("the same backfill, --reprocess-behavior completed ...")
        with status, self.timed("step 4b"):
            second = self.backfill("completed")
        self.check(
            [r.state for r in second] == ["success"] * len(week)
            and all(r.clear_number > 0 for r in second),
            f"the {len(second)} completed runs were cleared and ran again, all success",
            self.run_failed([r.run_id for r in second]),
        )
        attempts = self.attempts(week, marker)
        by_job: dict[str, dict[str, int]] = {}
        for a in attempts:
            by_job.setdefault(a.job, {}).setdefault(a.outcome, 0)
            by_job[a.job][a.outcome] += 1
        self.table(
            "Second pass: attempts by job",
            ["job", "noop", "completed", "other"],
            [
                (
                    job,
                    by_job.get(job, {}).get("noop", 0),
                    by_job.get(job, {}).get("completed", 0),
                    sum(
                        n for k, n in by_job.get(job, {}).items() if k not in ("noop", "completed")
                    ),
                )
                for job in JOBS
            ],
        )
        covered = {(a.job, a.run_key) for a in attempts}
        self.check(
            {a.outcome for a in attempts} == {"noop"}
            and {a.triggered_by for a in attempts} == {"backfill"}
            and covered == {(j, d.isoformat()) for j in JOBS for d in week},
            f"all {len(attempts)} attempts of the second pass are no-ops (every job, every date)",
            str(attempts),
        )
        sent = self.requests() - requests
        self.check(
            sent == 0,
            f"0 requests to the accounting service (the first pass made {first_requests:,})",
            f"{sent} requests",
        )
        self.check(self.fingerprint(week) == before, "nothing rewritten in the job database")

    def step_crash(self) -> None:
        day, at, n = CRASH_DATE, self.plan.crash_at, self.plan.crash_orders
        point = f"ledger.after_remote_commit@{at}"
        self.section(
            5,
            f"A worker killed in the middle of the export of {day}, then the rerun",
            f"`airflow dags test` of the nightly run with AIRFLOW_IDEMPOTENCY_CRASH_AT={point}: "
            f"SIGKILL right after the accounting service committed invoice #{at}, before the "
            "ledger recorded it. The ledger claims (pending) and confirms invoices 50 at a "
            "time, 16 calls in flight.",
        )
        with self.console.status("the worker runs until it is killed ..."), self.timed("step 5a"):
            worker = self.start_dags_test(
                "crash",
                logical_date=fire_time(day),
                extra_env={"AIRFLOW_IDEMPOTENCY_CRASH_AT": point},
            )
            code = worker.wait(600)
            worker.kill()  # whatever it had started dies with it
        self.check(
            f"fault point {point}: SIGKILL" in worker.text(),
            f"the worker was SIGKILLed at {point} (exit {code}, log {rel(worker.log)})",
            f"no SIGKILL in {rel(worker.log)}; exit {code}",
        )
        middle = self.date_state(day)
        claimed = middle["ledger_succeeded"] + middle["ledger_pending"] + middle["ledger_failed"]
        status = self.rows(
            "SELECT split_part(job_name, '.', 2), status FROM idempotency.job_runs"
            " WHERE run_key = %s ORDER BY job_name",
            (day.isoformat(),),
        )
        locks = self.value(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
            " WHERE l.locktype = 'advisory' AND d.datname = current_database()"
        )
        self.table(
            "Left behind by the crash",
            ["", "count"],
            [
                ("orders = invoices to export", n),
                ("invoices the accounting service has", middle["remote"]),
                ("ledger: confirmed (succeeded)", middle["ledger_succeeded"]),
                ("ledger: pending (claimed; sent or not, nobody knows)", middle["ledger_pending"]),
                ("ledger: not claimed yet", n - claimed),
                ("job_runs", ", ".join(f"{j} {st}" for j, st in status)),
                ("advisory locks held (died with the session)", locks),
            ],
        )
        self.check(
            0 < middle["ledger_succeeded"] < middle["remote"] < n
            and middle["ledger_pending"] > 0
            and locks == 0,
            "the export stopped half-way: confirmed, pending and unsent invoices; no lock left",
            str(middle),
        )

        requests, replays = self.requests(), int(self.service.stats()["replays"])
        self.say(f"The rerun, by hand through Airflow: conf {{'run_key': '{day}'}}")
        with self.console.status("Airflow reruns the date ..."), self.timed("step 5b"):
            run = self.trigger(conf={"run_key": day.isoformat()})
        self.check(
            run.state == "success",
            f"Airflow run {run.run_id} finished: {run.state}",
            self.run_failed([run.run_id]),
        )
        export = self.details(day, "export_invoices")
        after = self.date_state(day)
        replayed = int(self.service.stats()["replays"]) - replays
        self.table(
            "The rerun (export_invoices took over the started run)",
            ["", "count"],
            [
                ("skipped: confirmed before the crash", export.get("exports_skipped_existing")),
                ("sent: pending and unclaimed, each with its SAME key", export.get("exports_sent")),
                ("  of which the service already had (replayed)", replayed),
                ("requests to the service", self.requests() - requests),
                ("invoices the accounting service has now", after["remote"]),
            ],
        )
        self.check(
            export.get("exports_skipped_existing") == middle["ledger_succeeded"]
            and export.get("exports_sent") == n - middle["ledger_succeeded"],
            f"the {middle['ledger_succeeded']} confirmed invoices were not sent again, "
            f"the other {n - middle['ledger_succeeded']} were",
            str(export),
        )
        lost = middle["remote"] - middle["ledger_succeeded"]
        self.check(
            replayed >= lost,
            f"the {lost} the service got before the crash were answered from its idempotency "
            "keys, not created again",
            f"replays {replayed}, expected at least {lost}",
        )
        ok, detail = self.converged(day)
        self.check(
            ok, f"{after['remote']:,} remote invoices for {n:,} orders: no duplicate", detail
        )

    def step_summary(self) -> None:
        self.section(6, "Final state")
        job_runs = self.rows(
            "SELECT split_part(job_name, '.', 2), status, count(*), min(run_key), max(run_key)"
            " FROM idempotency.job_runs GROUP BY 1, 2 ORDER BY 1, 2"
        )
        self.table(
            "job_runs (one row per job and business date)",
            ["job", "status", "run keys", "from", "to"],
            job_runs,
        )
        counts: dict[str, dict[str, int]] = {}
        for job, outcome, count in self.rows(
            "SELECT split_part(job_name, '.', 2), outcome, count(*)"
            " FROM idempotency.job_run_attempts GROUP BY 1, 2"
        ):
            counts.setdefault(job, {})[outcome] = count
        present = [o for o in OUTCOMES if any(o in c for c in counts.values())]
        present += sorted({o for c in counts.values() for o in c} - set(present))
        self.table(
            "job_run_attempts by job and outcome",
            ["job", *present, "total"],
            [
                (job, *(c.get(o, 0) for o in present), sum(c.values()))
                for job, c in sorted(counts.items())
            ],
        )
        legend = {
            "noop": "noop = the key was already completed (steps 2, 3 and 4)",
            "lock_held": "lock_held = blocked by the run holding the key (step 3)",
            "running": "running = the attempt SIGKILLed in step 5: it never finished, its lock "
            "died with its session and the rerun took over",
        }
        for outcome, text in legend.items():
            if outcome in present:
                self.say(f"[dim]{text}[/dim]")
        ledger = self.rows(
            "SELECT status, count(*), sum(call_count) FROM idempotency.outbound_ledger"
            " GROUP BY 1 ORDER BY 1"
        )
        self.table("outbound ledger", ["status", "effects", "calls"], ledger)
        orders = int(self.value("SELECT count(*) FROM orders"))
        invoices = int(self.value("SELECT count(*) FROM invoices"))
        stats = self.service.stats()
        duplicates = self.rows(
            "SELECT invoice->>'order_id', count(*) FROM accounting.invoices"
            " GROUP BY 1 HAVING count(*) > 1"
        )
        unknown = self.value(
            "SELECT count(*) FROM accounting.invoices a WHERE NOT EXISTS"
            " (SELECT FROM orders o WHERE o.order_id::text = a.invoice->>'order_id')"
        )
        self.table(
            "Accounting service vs the job database",
            ["", "count"],
            [
                ("orders", orders),
                ("invoices (job database)", invoices),
                ("invoices (accounting service, GET /api/stats)", stats["invoices"]),
                ("orders with more than one remote invoice", len(duplicates)),
                ("remote invoices for no known order", unknown),
                ("requests served / replayed", f"{stats['requests']:,} / {stats['replays']:,}"),
            ],
        )
        expected_runs = len(JOBS) * len(self.plan.all_dates)
        self.check(
            [(j, s) for j, s, *_ in job_runs] == [(j, "completed") for j in sorted(JOBS)]
            and sum(r[2] for r in job_runs) == expected_runs,
            f"{expected_runs} job runs ({len(JOBS)} jobs x {len(self.plan.all_dates)} dates),"
            " all completed",
            str(job_runs),
        )
        self.check(
            [r[0] for r in ledger] == ["succeeded"] and ledger[0][1] == orders,
            f"{orders:,} ledger rows, all succeeded",
            str(ledger),
        )
        self.check(
            orders == invoices == stats["invoices"] == self.plan.total_orders,
            f"{orders:,} orders = {invoices:,} invoices = {stats['invoices']:,} remote invoices",
        )
        self.check(
            not duplicates and unknown == 0,
            "no duplicates: exactly one remote invoice per order",
            str(duplicates[:10]),
        )

    # ---------------------------------------------------------------- the whole demo

    def run(self) -> None:
        from devtools.airflow_stack import airflow_stack

        started = time.monotonic()
        with contextlib.ExitStack() as resources:
            try:
                self.console.rule(
                    "[bold]Idempotent nightly batch jobs: a guided demo", style="bold"
                )
                self.say(f"work folder {rel(self.workdir)}/ (Airflow home, logs; wiped at start)")
                with self.timed("set-up"):
                    self.setup_database(resources)
                    self.say(f"PostgreSQL: {self.server_note}, database [bold]{self.db_name}[/]")
                    self.start_service(resources)
                    self.say(f"accounting service: {self.service.url} (pid {self.service.pid})")
                    resources.callback(self.kill_workers)
                    self.seed()
                home = self.workdir / "airflow"
                self.say(
                    "starting Airflow: api-server, scheduler, dag-processor "
                    f"[dim](logs in {rel(home / 'stack-logs')}/)[/dim]"
                )
                airflow = contextlib.ExitStack()
                resources.callback(airflow.close)
                with self.console.status("Airflow is starting ..."), self.timed("Airflow start"):
                    self.stack = airflow.enter_context(
                        airflow_stack(home, DAGS_FOLDER, self.conn_env, start_timeout=300)
                    )
                    self.stack.unpause(DAG_ID, timeout=300)
                self.say(
                    f"Airflow answers on {self.stack.base_url} after "
                    f"{self.timings['Airflow start']:.0f} s; {DAG_ID} unpaused"
                )
                self.step_nightly_run()
                self.step_manual_rerun()
                self.step_two_at_once()
                self.step_backfill()
                self.step_crash()
                with shielded(), self.timed("Airflow stop"):
                    airflow.close()
                self.step_summary()
            finally:
                _cleaning_begins()
        self.timings["total"] = time.monotonic() - started


def _cleaning_begins() -> None:
    global _cleaning
    _cleaning = True


@contextlib.contextmanager
def _timer(timings: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    finally:
        timings[name] = time.monotonic() - t0


def _pair(details: dict[str, Any], a: str, b: str) -> str:
    return f"{details.get(a, '-')} / {details.get(b, '-')}"


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if value is None:
        return "-"
    return str(value)


# -- entry point ----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 dev.py demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--orders", type=int, help="orders of business date 2026-10-01 (default 1287; 200 quick)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller numbers and a 3-day backfill (the test)"
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the work folder and the database afterwards (until the next demo run)",
    )
    parser.add_argument(
        "--workdir", type=Path, default=ROOT / ".demo", help="work folder (default .demo/)"
    )
    args = parser.parse_args(argv)
    if args.orders is not None and args.orders < 1:
        parser.error("--orders must be at least 1")
    return args


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


def next_steps(demo: Demo, console: Console) -> None:
    """What to run next: the operator CLI, Airflow's CLI and psql on what the demo left."""
    workdir = rel(demo.workdir)
    console.print()
    console.rule("[bold]Next", align="left")
    if demo.args.keep:
        console.print(
            f"  Kept: {workdir}/ and database {demo.db_name} (dropped by the next demo run).",
            highlight=False,
        )
        if demo.server_source == "embedded":
            data = rel(ROOT / ".pgdata" / "data")
            console.print(
                "  The embedded server was stopped. Start it (it stays up) and stop it with\n"
                f"    .venv/bin/python -c \"import pgserver; pgserver.get_server('{data}', "
                'cleanup_mode=None)"\n'
                f"    .venv/bin/python -c \"import pgserver; pgserver.get_server('{data}')\"",
                highlight=False,
                soft_wrap=True,
            )
    else:
        console.print(
            "  The database was dropped and the work folder removed. To look around, run "
            "[bold]python3 dev.py demo --keep[/], then:",
            highlight=False,
        )
    commands = [
        ("in a new shell: AIRFLOW_HOME, connections and AIRFLOW_IDEMPOTENCY_DSN of the demo",
         f"source {workdir}/env.sh"),
        ("job runs, one run with its attempts, the ledger: the operator CLI",
         "python3 dev.py cli runs"),
        ("", f"python3 dev.py cli show {DAG_ID}.export_invoices {CRASH_DATE}"),
        ("", "python3 dev.py cli ledger --all"),
        ("the demo's Airflow runs", f".venv/bin/airflow dags list-runs {DAG_ID}"),
        ("the job database", 'psql "$AIRFLOW_IDEMPOTENCY_DSN"'),
        ("the same demo with 1,287 orders on 2026-10-01 and a 7-day backfill",
         "python3 dev.py demo"),
    ]  # fmt: skip
    if not demo.args.quick:
        commands.pop()
    for what, command in commands:
        if what:
            console.print(f"  [dim]# {what}[/dim]", highlight=False)
        console.print(f"  {command}", highlight=False, soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    width = None if sys.stdout.isatty() else 110
    console = Console(width=width, highlight=False)
    for var in [k for k in os.environ if k.startswith("AIRFLOW")]:
        del os.environ[var]  # the demo's Airflow must not see the caller's settings
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    workdir = args.workdir.resolve()
    _lock = prepare_workdir(workdir)
    demo = Demo(args, Plan.build(args.quick, args.orders), console, workdir)
    failure: str | None = None
    try:
        demo.run()
    except DemoFailure as exc:
        failure = f"a check failed: {exc}"
    except KeyboardInterrupt as exc:
        failure = f"interrupted ({exc or 'SIGINT'})"
    except Exception as exc:  # reported with its traceback file, then exit 1
        trace = workdir / "logs" / "demo-traceback.log"
        trace.write_text(traceback.format_exc())
        failure = f"{type(exc).__name__}: {exc}\n(traceback in {rel(trace)})"
    left: list[str] = []
    for _ in range(40):  # backends of a closed connection take a moment to exit
        left = leftover_processes(workdir, demo.db_name)
        if not left:
            break
        time.sleep(0.25)
    if left:
        failure = (
            (failure + "\n" if failure else "") + "processes left running:\n  " + "\n  ".join(left)
        )
    if failure:
        console.print()
        console.print(f"[bold red]DEMO FAILED[/]: {failure}", highlight=False)
        console.print(
            f"  logs: {rel(workdir / 'logs')}/, {rel(workdir / 'airflow' / 'stack-logs')}/, "
            f"task logs in {rel(workdir / 'airflow' / 'logs')}/ (kept)",
            highlight=False,
        )
        return 130 if failure.startswith("interrupted") else 1

    console.print()
    console.rule("[bold green]All checks passed", align="left", style="green")
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in demo.timings.items() if k != "total")
    console.print(
        f"  {demo.checks} checks passed in {demo.timings['total']:.0f} s ({timing})",
        highlight=False,
    )
    console.print(
        "  no process left running (Airflow, accounting service, workers)", highlight=False
    )
    next_steps(demo, console)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
