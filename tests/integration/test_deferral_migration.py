"""Migration 15 (an attempt may end ``deferred``) on a database of the previous release with
rows of every outcome and a run of the previous release in flight: the migration applies
within its bounds while that run works, the run completes after it, a deferral is recorded
afterwards, the widened check still refuses an unknown outcome and validates over every row.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from airflow_idempotency import schema as schema_mod
from airflow_idempotency._sql import migrations
from airflow_idempotency.migrator import MigrationBounds
from airflow_idempotency.run_steps import WorkDeferred
from airflow_idempotency.runner import RunContext, RunOptions, RunOutcome, run_idempotently
from support.db import rows

FAST = MigrationBounds(lock_timeout=0.3, give_up_after=10.0, idle_in_transaction=5.0)


def _run(dsn: str, key: str, work: Any, **options: bool) -> Any:
    return run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name="j",
        run_key=key,
        work=work,
        options=RunOptions(**options),
    )


def _ensure(dsn: str) -> int:
    schema_mod._migrated.clear()
    with psycopg.connect(dsn, autocommit=True) as conn:
        return schema_mod.ensure_schema(conn, "idempotency", bounds=FAST)


def test_every_outcome_passes_the_widened_check_of_migration_15(pg_dsn: str) -> None:
    """Rows of every outcome, then the check migration 15 added NOT VALID is validated: it
    holds them all and still refuses an unknown outcome, and it is the only outcome check.

    (This test first ran the runs before the migration, with a run of the previous release in
    flight across it. Since migration 16 the decision calls ``run_decide``, so this code cannot
    run against a version-14 schema; a run in flight across a migration is
    test_rolling_upgrade's.)"""
    assert any(f.name == "0015_attempt_deferred.sql" for f in migrations())
    assert _ensure(pg_dsn) == len(migrations())

    def fail(ctx: RunContext) -> None:
        raise ZeroDivisionError("failed")

    _run(pg_dsn, "done", lambda ctx: {"n": 1})
    _run(pg_dsn, "done", lambda ctx: pytest.fail("a no-op"))
    _run(pg_dsn, "dry", lambda ctx: {"n": 1}, dry_run=True)
    with pytest.raises(ZeroDivisionError):
        _run(pg_dsn, "failed", fail)
    assert _run(pg_dsn, "in-flight", lambda ctx: {"n": 2}).outcome is RunOutcome.COMPLETED

    def defer(ctx: RunContext) -> None:
        raise WorkDeferred(KeyError("waiting"))

    with pytest.raises(WorkDeferred):
        _run(pg_dsn, "deferring", defer)
    assert _run(pg_dsn, "deferring", lambda ctx: {"n": 3}).outcome is RunOutcome.COMPLETED
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "ALTER TABLE idempotency.job_run_attempts VALIDATE CONSTRAINT "
            "job_run_attempts_outcome_check"
        )
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                "UPDATE idempotency.job_run_attempts SET outcome = 'paused' WHERE run_key = 'done'"
            )
    checks = rows(
        pg_dsn,
        "SELECT count(*) FROM pg_constraint WHERE conrelid = 'idempotency.job_run_attempts'::regclass"
        " AND contype = 'c' AND pg_get_constraintdef(oid) LIKE '%outcome%'",
    )
    assert checks == [(1,)]  # one outcome check, not the old one beside the new
    assert rows(
        pg_dsn,
        "SELECT run_key, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id",
    ) == [
        ("done", "completed"),
        ("done", "noop"),
        ("dry", "dry_run"),
        ("failed", "failed"),
        ("in-flight", "completed"),
        ("deferring", "deferred"),
        ("deferring", "completed"),
    ]
