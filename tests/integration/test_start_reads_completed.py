"""The start reads the run again after its take-over's wait (sql: start_attempt).

The decision reads the run before the start waits for the previous attempt's open
transactions: a completion can land in between (in the lease mode, a completion of an expired
holder whose COMMIT became visible late: tests/integration/test_lease_adversary.py). Here a
run stops after its decision (a fault point) while the key is marked completed, in both lock
modes: unforced, the start records a no-op and the work never runs; forced, it takes over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_idempotency import crashpoints
from airflow_idempotency.records import RunOptions
from airflow_idempotency.runner import RunContext, RunOutcome, run_idempotently
from support.db import rows
from support.locks import Background, advisory_locks, wait_for

JOB, KEY = "late_completion_job", "2026-11-30"

COMPLETE = """
WITH run AS (
    UPDATE idempotency.job_runs
    SET status = 'completed', completed_at = clock_timestamp(), updated_at = clock_timestamp()
    WHERE job_name = %(job)s AND run_key = %(key)s
    RETURNING current_attempt_id
)
UPDATE idempotency.job_run_attempts AS a
SET outcome = 'completed', details = a.details || '{"counts": {"rows": 7}}'::jsonb
FROM run WHERE a.attempt_id = run.current_attempt_id
"""


def run(dsn: str, work: Any, force: bool = False) -> Any:
    return run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=JOB,
        run_key=KEY,
        work=work,
        options=RunOptions(force=force),
    )


def fails(ctx: RunContext) -> None:
    raise RuntimeError("the first attempt failed")


@pytest.mark.parametrize("force", [False, True], ids=["unforced", "forced"])
def test_a_run_completed_after_the_decision_is_not_taken_over_unless_forced(
    pg_dsn: str,
    lock_mode: str,
    force: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(RuntimeError):
        run(pg_dsn, fails)  # the key exists, failed: the decision lets the next run start
    gate = tmp_path / "go"
    monkeypatch.setenv(crashpoints.WAIT_ENV, f"runner.after_lock={gate}")
    monkeypatch.setattr(crashpoints, "_slept", {})
    worked: list[str] = []
    second = Background(lambda: run(pg_dsn, lambda ctx: worked.append("again"), force))
    wait_for("the run to stop after its decision", lambda: bool(crashpoints._slept))
    rows(pg_dsn, COMPLETE, {"job": JOB, "key": KEY})  # a completion lands after the read
    gate.touch()
    result = second.join().result
    assert second.error is None, second.error
    (status,) = rows(pg_dsn, "SELECT status FROM idempotency.job_runs WHERE run_key = %s", (KEY,))[
        0
    ]
    outcome, details = rows(
        pg_dsn,
        "SELECT outcome, details FROM idempotency.job_run_attempts WHERE attempt_id = %s",
        (result.attempt_id,),
    )[0]
    if force:
        assert result.outcome is RunOutcome.COMPLETED and worked == ["again"]
        assert (status, outcome) == ("completed", "completed")
    else:
        assert result.outcome is RunOutcome.NOOP, result
        assert worked == [], "the work ran again on a completed key"
        assert result.counts == {"rows": 7}  # the completed run's counts, replayed
        assert (status, outcome) == ("completed", "noop")
        assert details["completed_before_start"] is True
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.run_leases")[0][0] == 0
    assert advisory_locks(pg_dsn) == 0, "the key was left locked"
