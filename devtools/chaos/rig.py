"""What every phase of a chaos run shares: the job database, the accounting service, the stack.

The job database lives on a PRIVATE embedded PostgreSQL (private so that the ``pg_restart``
fault may restart it); Airflow's metadata on a temporary database of the shared server (or
SQLite with ``--airflow-db sqlite``). The accounting service is restarted on the same port
whenever it died. Between phases (:meth:`Rig.switch_to`) the job database is made afresh under
the same name (so the same DSN), the service restarted, and the scheduler restarted with the
next build's PYTHONPATH and sleep points, and with the next phase's lock mode in the job
database's Airflow connection (its extra ``lock_mode``, which the task processes read):
:meth:`Rig.check_mode_used` checks at the end of a phase that its runs held their keys so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urlsplit

import psycopg

from devtools import invariants
from devtools.airflow_env import DAGS_FOLDER, ROOT, airflow_connection_json, connection_env
from devtools.chaos.builds import Build, patched_copy
from devtools.chaos.phases import Event, Phase, say
from devtools.invariants import FINALIZE

if TYPE_CHECKING:
    from devtools.accounting import AccountingService
    from devtools.airflow_stack import AirflowStack
    from devtools.postgres import PostgresServer

DATABASE = "chaos"
RECONCILE_DAGS = ("daily_reconciliation", "daily_reconciliation_pasted_twice")
CHAOS_DAGS = (FINALIZE, *RECONCILE_DAGS)
TERMINAL = frozenset({"success", "failed"})
LEASE_TTL = 15
"""The lease mode's ``lease_ttl`` in chaos (seconds; the default is 30): a crashed worker's key
is free again sooner, and a heartbeat starved on a busy machine lets its key be taken over
more often (the fence must hold then too)."""

_T = TypeVar("_T")


def retrying(what: Callable[[], _T], attempts: int = 30) -> _T:
    """``what()``, again while the database is restarting."""
    for attempt in range(attempts):
        try:
            return what()
        except psycopg.OperationalError:
            if attempt == attempts - 1:
                raise
            time.sleep(1)
    raise AssertionError("unreachable")


class Remote:
    """The accounting service on the job database, started again on the same port."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.service: AccountingService | None = None
        self._cm: contextlib.AbstractContextManager[AccountingService] | None = None
        self.port = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        assert self.service is not None
        return self.service.url

    def start(self) -> None:
        from devtools.accounting import run_accounting_service

        with self.lock:
            cm = run_accounting_service(self.dsn, port=self.port or None)
            service = cm.__enter__()
            self.service, self._cm = service, cm
            self.port = urlsplit(service.url).port or 0

    def stop(self, kill: bool = False) -> None:
        with self.lock:
            if self.service is None:
                return
            if kill:
                self.service.kill()
            with contextlib.suppress(Exception):
                assert self._cm is not None
                self._cm.__exit__(None, None, None)
            self.service = None

    def ensure(self) -> None:
        """The service answers; restarted (same port) if it died (e.g. with the database)."""
        from devtools.accounting import AccountingServiceError

        with contextlib.suppress(Exception):
            if self.service is not None and self.service.process.poll() is None:
                self.service.stats()
                return
        self.stop(kill=True)
        for attempt in range(10):
            try:
                self.start()
                return
            except AccountingServiceError:
                if attempt == 9:
                    raise
                time.sleep(1)

    def set_faults(self, **settings: Any) -> bool:
        """The service's fault injection set to ``settings``; False if the service is down."""
        with self.lock:
            if self.service is None:
                return False
            self.service.set_faults(**settings)
            return True

    def clear_faults(self) -> None:
        with self.lock, contextlib.suppress(Exception):
            if self.service is not None:
                self.service.set_faults(
                    fail_rate=0.0, reset_rate=0.0, timeout_after_commit_rate=0.0, latency_ms=0.0
                )


class Rig:
    """The job database, the service and the stack, shared by the phases."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir: Path = args.workdir.resolve()
        self.fault_dir = self.workdir / "faults"
        self.dsn = ""
        self.pg: PostgresServer
        self.remote: Remote
        self._stack: AirflowStack | None = None
        self.revive_lock = threading.Lock()
        self.revived: Counter[str] = Counter()

    @property
    def stack(self) -> AirflowStack:
        assert self._stack is not None
        return self._stack

    @contextlib.contextmanager
    def up(self, first: Phase) -> Iterator[None]:
        """A fresh work folder, the private server with the job database of ``first``, the
        service and the stack running ``first``'s build; all stopped on exit."""
        from devtools.postgres import find_server, private_embedded, temporary_database

        if self.workdir.exists():
            shutil.rmtree(self.workdir)
        self.workdir.mkdir(parents=True)
        self.fault_dir.mkdir()
        with contextlib.ExitStack() as stack:
            self.pg = stack.enter_context(private_embedded("chaos"))
            self.pg.create_database(name=DATABASE)
            self.dsn = self.pg.dsn(DATABASE)
            self.remote = Remote(self.dsn)
            metadata_dsn = None
            if self.args.airflow_db == "postgres":
                # Airflow's metadata on the shared server, not the private one the faults
                # restart: the scheduler on SQLite died of "database is locked" in long runs.
                metadata_dsn = stack.enter_context(
                    temporary_database(find_server(), "idem_chaos_airflow")
                )
            stack.callback(self.remote.stop)
            self.prepare_database(first)
            self.remote.start()
            stack.callback(self.stop_stack)
            self.start_stack(first, metadata_dsn)
            yield

    # ---------------------------------------------------------------- reads and calls

    def db_rows(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        def read() -> list[tuple[Any, ...]]:
            with psycopg.connect(self.dsn, connect_timeout=10) as conn:
                return conn.execute(sql, params).fetchall()

        return retrying(read)

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """The REST API, again on a 5xx."""
        from devtools.airflow_stack import StackError

        for attempt in range(1, 7):
            try:
                return self.stack.api(method, path, body)
            except StackError as exc:
                if "-> 5" not in str(exc) or attempt == 6:
                    raise
                time.sleep(attempt)
        return None

    def trigger(
        self, dag_id: str, logical_date: str | None, conf: dict[str, Any]
    ) -> tuple[str, str] | None:
        """POST a DAG run; None if Airflow refused it (e.g. that logical date exists)."""
        from devtools.airflow_stack import StackError

        body = {"logical_date": logical_date, "conf": conf}
        try:
            run = self.api("POST", f"/api/v2/dags/{dag_id}/dagRuns", body)
        except StackError as exc:
            if "-> 409" in str(exc) or "-> 400" in str(exc):
                return None
            raise
        return dag_id, str(run["dag_run_id"])

    def wait_runs(self, phase: Phase, run_ids: list[tuple[str, str]], timeout: float) -> str:
        """The runs' states once all are finished (or gone), or ``timeout:<states>``."""
        deadline = time.monotonic() + timeout
        while True:
            self.revive(phase)
            states: list[str] = []
            for dag_id, run_id in run_ids:
                run = self.stack.dag_run(dag_id, run_id)
                states.append((run.state or "none") if run else "missing")
            if all(s in TERMINAL or s == "missing" for s in states):
                return ",".join(states) or "no runs"
            if time.monotonic() > deadline:
                return "timeout:" + ",".join(str(s) for s in states)
            time.sleep(1)

    def revive(self, phase: Phase) -> None:
        """Start again a stack component that died (an infrastructure failure of the test
        stack, logged, not an invariant of the provider)."""
        revivable = ("api-server", "scheduler", "dag-processor")
        with self.revive_lock:
            for name, proc in list(self.stack.procs.items()):
                if proc.poll() is None or name not in revivable:
                    continue
                phase.log(Event(phase.steps, "revive", name, time.monotonic()))
                say(f"airflow {name} exited ({proc.returncode}): starting it again")
                self.revived[name] += 1
                self.stack.start_component(name)

    # ---------------------------------------------------------------- builds and phases

    def prepare_database(self, phase: Phase) -> None:
        """The phase's job database: empty, with the example's orders of its dates."""
        from invoicing.seed import seed_orders

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            dates = phase.dates
            seed_orders(conn, dates[0], dates[-1], self.args.orders, phase.seed % 1000)
        invariants.prepare(self.dsn)

    def phase_env(self, phase: Phase) -> dict[str, str]:
        """The stack's variables that change with the phase: the build's PYTHONPATH and sleep
        points, and the job database's connection with the phase's lock mode in its extra."""
        build = phase.build
        connection = json.loads(airflow_connection_json(self.dsn))
        connection["extra"] = {"lock_mode": phase.lock_mode}
        if phase.lock_mode == "lease":
            connection["extra"]["lease_ttl"] = LEASE_TTL
        folder = None
        if build.broken:
            folder = str(patched_copy(build, self.workdir / "builds" / build.name))
            say(f"BROKEN BUILD: {build.name}: {build.what} (patched copy in {folder})")
        pythonpath = [
            p for p in (folder, str(ROOT), str(DAGS_FOLDER), os.environ.get("PYTHONPATH")) if p
        ]
        env = {
            "PYTHONPATH": os.pathsep.join(pythonpath),
            "AIRFLOW_CONN_IDEMPOTENCY_DEFAULT": json.dumps(connection),
        }
        if build.sleep_at:
            env["AIRFLOW_IDEMPOTENCY_SLEEP_AT"] = build.sleep_at
        return env

    def start_stack(self, phase: Phase, metadata_dsn: str | None) -> None:
        from devtools.airflow_stack import AirflowStack

        env = {
            **connection_env(self.dsn, self.remote.url, batch_size=10, unreachable_after=10),
            "AIRFLOW_IDEMPOTENCY_FAULT_DIR": str(self.fault_dir),
            "AIRFLOW__CORE__PARALLELISM": str(self.args.parallelism),
            **self.phase_env(phase),
        }
        self._stack = AirflowStack(
            self.workdir / "airflow", DAGS_FOLDER, env, metadata_dsn=metadata_dsn
        )
        self.check_build_is_used(phase.build)
        self.stack.start(300)
        for dag_id in CHAOS_DAGS:
            self.stack.unpause(dag_id, timeout=300)

    def stop_stack(self) -> None:
        if self._stack is not None:
            self._stack.stop()

    def check_build_is_used(self, build: Build) -> None:
        """The stack's processes import the phase's provider: the patched copy or this
        checkout's."""
        found = subprocess.run(
            [sys.executable, "-c", "import airflow_idempotency as p; print(p.__file__)"],
            env=self.stack.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        wanted = self.workdir / "builds" / build.name if build.broken else ROOT / "provider"
        if not found.startswith(str(wanted)):
            raise SystemExit(f"build {build.name}: the stack would import {found}, not {wanted}")

    def check_mode_used(self, phase: Phase) -> str:
        """Whether ``phase``'s runs held their keys in its lock mode (sets
        ``phase.mode_used``), said in words. The runs that started (not a no-op, a refusal or
        a reset) record the backend of their lock session in the advisory mode, none in the
        lease mode, where the job database drew a lease token for each."""
        started, by_session = self.db_rows(
            "SELECT count(*), count(lock_backend_pid) FROM idempotency.job_run_attempts"
            " WHERE outcome NOT IN ('noop', 'lock_held', 'reset')"
        )[0]
        tokens = self.db_rows(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END"
            " FROM idempotency.run_lease_tokens"
        )[0][0]
        found = (
            f"{started} attempts started, {by_session} of them under a lock session; "
            f"{tokens} lease tokens drawn"
        )
        if phase.lock_mode == "lease":
            phase.mode_used = started > 0 and by_session == 0 and tokens > 0
        else:
            phase.mode_used = started > 0 and by_session == started and tokens == 0
        if not phase.mode_used:
            say(f"phase {phase.name}: its runs did NOT hold their keys in that mode: {found}")
        return found

    def switch_to(self, phase: Phase) -> None:
        """A fresh job database and service, and a scheduler that imports ``phase``'s build."""
        t0 = time.monotonic()
        self.remote.stop()
        self.pg.drop_database(DATABASE)
        self.pg.create_database(name=DATABASE)
        for armed in self.fault_dir.iterdir():
            armed.unlink()
        self.prepare_database(phase)
        self.remote.start()
        for name in ("AIRFLOW_IDEMPOTENCY_SLEEP_AT", "PYTHONPATH"):
            self.stack.env.pop(name, None)
        self.stack.env.update(self.phase_env(phase))
        self.check_build_is_used(phase.build)
        self.stack.restart_component("scheduler")
        for dag_id in CHAOS_DAGS:
            self.stack.unpause(dag_id)
        say(f"phase {phase.name}: switched in {time.monotonic() - t0:.0f} s")

    def end_phase(self, phase: Phase) -> None:
        """Stop what a phase ended by a violation still runs: no new tasks, its runs failed,
        its backfills done (the next phase's scheduler, restarted, starts on a clean slate)."""
        for dag_id in CHAOS_DAGS:
            with contextlib.suppress(Exception):
                self.stack.pause(dag_id)
        for row in self.stack.query(
            "SELECT dag_id, run_id FROM dag_run WHERE state IN ('running', 'queued') AND id > ?",
            (phase.base_run_id,),
        ):
            with contextlib.suppress(Exception):
                quoted = quote(row["run_id"], safe="")
                self.api(
                    "PATCH", f"/api/v2/dags/{row['dag_id']}/dagRuns/{quoted}", {"state": "failed"}
                )
        for backfill_id in phase.backfills:
            with contextlib.suppress(Exception):
                self.stack.mark_backfill_complete(backfill_id)
