"""No wait without a bound, on a real PostgreSQL (issue 30, item 1): a run behind a pending
migration (a session holding the bookkeeping tables) ends within the bound with an error that
names the session it waited for; the bound is a setting, refused when it is not a number."""

from __future__ import annotations

import time

import psycopg
import pytest

from airflow_idempotency.exceptions import ConfigurationError, LockWaitError
from airflow_idempotency.locks import LOCK_WAIT_ENV, lock_wait_ms
from airflow_idempotency.runner import RunOutcome, run_idempotently

JOB, KEY = "bounded_job", "2026-10-01"


def run(dsn: str) -> RunOutcome:
    result = run_idempotently(
        connect=lambda: psycopg.connect(dsn), job_name=JOB, run_key=KEY, work=lambda ctx: None
    )
    return result.outcome


@pytest.mark.parametrize("table", ["job_runs", "job_run_attempts", "fence_arms"])
def test_a_run_behind_a_held_bookkeeping_table_ends_within_the_bound(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, table: str
) -> None:
    """A session holding a bookkeeping table (as a migration's ALTER does) makes a run fail
    after the bound (1 s here), naming that session's pid and application_name, instead of
    waiting for it; once it lets go the run completes."""
    run_idempotently(  # the bookkeeping schema exists before the table is held
        connect=lambda: psycopg.connect(pg_dsn), job_name="other", run_key=KEY, work=lambda c: None
    )
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")
    with psycopg.connect(pg_dsn, application_name="a-migration") as holder:
        holder.execute(f"LOCK TABLE idempotency.{table} IN ACCESS EXCLUSIVE MODE")
        began = time.monotonic()
        with pytest.raises(LockWaitError) as waited:
            run(pg_dsn)
        took = time.monotonic() - began
        assert took < 15, f"the run waited {took:.1f} s"
        message = str(waited.value)
        assert f"backend pid {holder.info.backend_pid}" in message, message
        assert "'a-migration'" in message and "retry converges" in message
    assert run(pg_dsn) is RunOutcome.COMPLETED


@pytest.mark.parametrize("given", ["soon", "0", "-3", "100000"])
def test_a_lock_wait_bound_that_is_not_a_duration_is_refused(
    monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    """AIRFLOW_IDEMPOTENCY_LOCK_WAIT must be seconds in (0, 86400]: anything else is refused,
    naming the variable; unset, the bound is 60 s."""
    monkeypatch.delenv(LOCK_WAIT_ENV, raising=False)
    assert lock_wait_ms() == "60000"
    monkeypatch.setenv(LOCK_WAIT_ENV, given)
    with pytest.raises(ConfigurationError, match=LOCK_WAIT_ENV):
        lock_wait_ms()
