"""What the demo's steps stand on: reads of the job database and the demo's Airflow.

The demo's Airflow: ``airflow dags test`` workers, REST calls, runs and their tasks.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psycopg

from devtools import invariants
from devtools.demo.output import rel
from devtools.demo.plan import DAG_ID
from devtools.demo.processes import Worker
from devtools.demo.setup import DemoSetup
from devtools.workers import dags_test, private_airflow_env


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


@dataclass(kw_only=True)
class DemoRig(DemoSetup):
    """The set-up demo with its Airflow: what every step reads, starts and triggers."""

    stack: Any = None
    workers: list[Worker] = field(default_factory=list)

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

    def check_succeeded(self, run: Any) -> None:
        """Check that the Airflow run ``run`` finished in success (else what it did, and where
        its logs are)."""
        self.check(
            run.state == "success",
            f"Airflow run {run.run_id} finished: {run.state}",
            self.run_failed([run.run_id]),
        )

    def run_failed(self, run_ids: Sequence[str]) -> Callable[[], str]:
        def describe() -> str:
            return (
                f"{self.stack.describe_runs(DAG_ID, run_ids)}\n"
                f"task logs: {rel(self.stack.home / 'logs' / f'dag_id={DAG_ID}')}/\n"
                f"scheduler log: {rel(self.stack.log_path('scheduler'))}"
            )

        return describe
