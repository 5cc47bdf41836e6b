"""An adversary's pass (adv34) over the lease mode's completion retried on a new connection
and its read-back of a lost try (lease_run.LeaseRun._complete_lease): each test is one attack
on a database of its own. A failing test is a defect found (its docstring says what breaks)."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from airflow_idempotency.leases import LockMode
from airflow_idempotency.runner import RunContext, run_idempotently
from support.db import rows

JOB, KEY = "adv34_job", "2026-12-07"
LONG = LockMode("lease", lease_ttl=300)  # no renewal during a test


def work(ctx: RunContext) -> dict[str, int]:
    with ctx.transaction() as cur:
        cur.execute("INSERT INTO public.facts VALUES ('once', %s)", (ctx.run_key,))
    return {"facts": 1}


def test_a_completion_committed_then_lost_past_the_lock_wait_is_completed(
    adv_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion's COMMIT lands (it releases the lease), but its reply comes late and the
    connection is then lost, after the lock wait (AIRFLOW_IDEMPOTENCY_LOCK_WAIT, 1 s here) has
    passed since the completion began: a completion that waited most of the lock wait for a
    slot, or a slow commit, then a failover. Expected: the attempt's outcome is read back (it
    says completed) and the run reports completed. Found: the read-back happened only on a
    second failure, and past the deadline there is no second try: the run reported
    LockLostError ("it is not marked completed") for a run it had completed."""
    from airflow_idempotency import lease_run

    monkeypatch.setenv("AIRFLOW_IDEMPOTENCY_LOCK_WAIT", "1")
    original = lease_run.LeaseRun._complete_and_release
    tries: list[bool] = []

    def commit_then_lose_late(self: Any, conn: psycopg.Connection, *args: Any) -> bool:
        done = original(self, conn, *args)
        tries.append(done)
        time.sleep(1.2)  # the reply late: past the lock wait
        conn.close()
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(lease_run.LeaseRun, "_complete_and_release", commit_then_lose_late)
    result = run_idempotently(
        connect=lambda: psycopg.connect(adv_db), job_name=JOB, run_key=KEY, work=work,
        lock_mode=LONG,
    )  # fmt: skip
    assert result.outcome.value == "completed"
    assert tries == [True], tries
    attempts = rows(adv_db, "SELECT outcome, error FROM idempotency.job_run_attempts")
    assert attempts == [("completed", None)], attempts
