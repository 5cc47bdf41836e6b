"""A rolling upgrade on a real PostgreSQL: old and new workers side by side (issue 30).

The procedure of docs/deploying.md ("Upgrading"): the new release's migration runs while runs
of the old release are in flight; an old run in flight stays fenced; once the schema is newer,
an old worker starts nothing and says so with a retryable error. The "new release" is this code
with one more migration (support.upgrades), the old one this code as it is.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from airflow_idempotency import schema as schema_mod
from airflow_idempotency.exceptions import LockLostError, SchemaTooNewError
from airflow_idempotency.migrator import MigrationBounds
from airflow_idempotency.runner import RunContext, RunOutcome, run_idempotently
from support.db import rows
from support.locks import terminate_lock_session
from support.upgrades import Releases


def run(dsn: str, run_key: str, work: Any = None) -> RunOutcome:
    """One run of job ``j`` through the public runner; its outcome."""
    result = run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name="j",
        run_key=run_key,
        work=work or (lambda ctx: None),
    )
    return result.outcome


def migrate(dsn: str) -> int:
    """`airflow-idempotency migrate` of the release this process runs, bounded for a test."""
    bounds = MigrationBounds(lock_timeout=0.5, give_up_after=10.0, idle_in_transaction=5.0)
    with psycopg.connect(dsn, autocommit=True) as conn:
        return schema_mod.ensure_schema(conn, "idempotency", bounds=bounds)


def recorded(dsn: str, run_key: str) -> list[tuple[Any, ...]]:
    """The run record and attempts of ``run_key``."""
    return rows(
        dsn,
        "SELECT 'run', status FROM idempotency.job_runs WHERE run_key = %(k)s UNION ALL "
        "SELECT 'attempt', outcome FROM idempotency.job_run_attempts WHERE run_key = %(k)s",
        {"k": run_key},
    )


def test_an_old_worker_after_the_migration_gets_a_retryable_error_and_writes_nothing(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old release runs, `migrate` of the new release, then a task on an old worker: it raises
    SchemaTooNewError (the operator turns it into a retryable failure), records nothing, and
    the retry on an upgraded worker runs the key once; keys done before the upgrade stay done."""
    from airflow.exceptions import AirflowException, AirflowFailException  # type: ignore[attr-defined]

    from airflow_idempotency.operator import IdempotentRunOperator

    releases = Releases(monkeypatch)
    releases.old()
    assert run(pg_dsn, "2026-10-01") is RunOutcome.COMPLETED
    releases.new()
    assert migrate(pg_dsn) == releases.probe.version
    assert run(pg_dsn, "2026-10-02") is RunOutcome.COMPLETED
    releases.old()  # a worker not yet upgraded picks up a task
    for key in ("2026-10-03", "2026-10-01"):
        with pytest.raises(SchemaTooNewError, match="Upgrade the provider on this worker") as old:
            run(pg_dsn, key)
    assert recorded(pg_dsn, "2026-10-03") == []
    assert recorded(pg_dsn, "2026-10-01") == [("run", "completed"), ("attempt", "completed")]
    operator = IdempotentRunOperator(task_id="t", python_callable=lambda run: None)
    failure = operator.airflow_failure({}, old.value)
    assert type(failure) is AirflowException and not isinstance(failure, AirflowFailException)
    releases.new()  # the retry, on an upgraded worker
    assert run(pg_dsn, "2026-10-03") is RunOutcome.COMPLETED
    assert run(pg_dsn, "2026-10-01") is RunOutcome.NOOP


def test_a_run_in_flight_across_the_migration_stays_fenced(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old worker's run is in flight while the new release migrates: the migration goes
    through without waiting for the run; when the old run then loses its lock and a new worker
    takes the key over, the old run's next write is refused (LockLostError) and only the new
    worker's row lands: nothing unfenced beside the new release."""
    rows(pg_dsn, "CREATE TABLE public.facts (written_by text NOT NULL)")
    releases = Releases(monkeypatch)
    releases.old()
    migrate(pg_dsn)
    in_work, go = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def old_work(ctx: RunContext) -> None:
        in_work.set()
        go.wait(30)
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('old')")

    def old_worker() -> None:
        try:
            outcome["result"] = run(pg_dsn, "2026-10-05", old_work)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=old_worker, daemon=True)
    thread.start()
    try:
        assert in_work.wait(30), outcome
        releases.new()
        assert migrate(pg_dsn) == releases.probe.version  # not held up by the run in flight
        terminate_lock_session(pg_dsn, "j", "2026-10-05")

        def new_work(ctx: RunContext) -> None:
            with ctx.transaction() as cur:
                cur.execute("INSERT INTO public.facts VALUES ('new')")

        assert run(pg_dsn, "2026-10-05", new_work) is RunOutcome.COMPLETED
    finally:
        go.set()
        thread.join(30)
    assert isinstance(outcome.get("error"), LockLostError), outcome
    assert rows(pg_dsn, "SELECT written_by FROM public.facts") == [("new",)]
    assert rows(pg_dsn, "SELECT status FROM idempotency.job_runs WHERE run_key = '2026-10-05'") == [
        ("completed",)
    ]
