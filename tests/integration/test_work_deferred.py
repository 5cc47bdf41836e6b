"""A work that defers (:class:`~airflow_idempotency.run_steps.WorkDeferred`, what the cluster
policy raises for Airflow's ``TaskDeferred``: docs/policy.md, deferrable operators), on a real
PostgreSQL, in both lock modes: the attempt ends ``deferred``, the run stays ``started``, the
lock is released at once (the next attempt takes the key), the caller gets its own exception
back, and ``runs --stale`` does not take the key for abandoned work."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from airflow_idempotency.gaps import stale
from airflow_idempotency.run_steps import WorkDeferred
from airflow_idempotency.runner import RunContext, RunOutcome, run_idempotently
from support.db import rows


class Deferral(BaseException):
    """Stands for Airflow's TaskDeferred (a BaseException on 3.x)."""


def _defer(ctx: RunContext) -> None:
    raise WorkDeferred(Deferral("waiting for a trigger"))


@pytest.mark.parametrize("mode", ["advisory", "lease"])
def test_a_deferral_ends_the_attempt_deferred_and_frees_the_key(pg_dsn: str, mode: str) -> None:
    def run(work: Any) -> Any:
        return run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn),
            job_name="deferring",
            run_key="2026-10-01",
            work=work,
            lock_mode=mode,
        )

    with pytest.raises(WorkDeferred) as raised:
        run(_defer)
    assert isinstance(raised.value.deferral, Deferral)
    assert rows(pg_dsn, "SELECT status, attempt_count FROM idempotency.job_runs") == [
        ("started", 1)
    ]
    assert rows(
        pg_dsn, "SELECT outcome, finished_at IS NOT NULL, error FROM idempotency.job_run_attempts"
    ) == [("deferred", True, None)]
    with psycopg.connect(pg_dsn) as conn:
        assert stale(conn, "idempotency") == []  # waiting for its trigger, not abandoned
    # the lock was released with the deferral: the resumption (a new attempt) takes the key
    assert run(lambda ctx: {"resumed": 1}).outcome is RunOutcome.COMPLETED
    assert run(lambda ctx: pytest.fail("a completed key runs no work")).outcome is RunOutcome.NOOP
    assert rows(pg_dsn, "SELECT outcome FROM idempotency.job_run_attempts ORDER BY attempt_id") == [
        ("deferred",),
        ("completed",),
        ("noop",),
    ]
