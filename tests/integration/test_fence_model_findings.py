"""What the fence's model check found (tests/model/fence.pml, docs/fence.md), on real PostgreSQL.

A start is not fenced by its own lock: an attempt whose lock session ended between taking the
run lock and its start can commit that start after its successor's, and take the run over from
it. Fixed by migration 0012: ``fence_take_over`` refuses a start whose lock is gone.
"""

from __future__ import annotations

from support.db import rows
from support.fenced_work import late_start_race

JOB = "finding"
KEY = "2026-10-01"


def test_a_start_after_its_lock_was_lost_does_not_take_the_run_over(pg_dsn: str) -> None:
    _, successor = late_start_race(pg_dsn, JOB, KEY)
    # the successor's write committed: the successor must be the run's completed attempt
    assert rows(pg_dsn, "SELECT n FROM finding_rows") == [(1,)]
    assert successor.error is None, successor.error
    assert rows(pg_dsn, "SELECT status FROM idempotency.job_runs") == [("completed",)]
