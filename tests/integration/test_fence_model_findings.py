"""What the fence's model check found (tests/model/fence.pml, docs/fence.md), on real PostgreSQL.

A start is not fenced by its own lock: an attempt whose lock session ended between taking the
run lock and its start can commit that start after its successor's, and take the run over from
it. Fixed by migration 0012: ``fence_take_over`` refuses a start whose lock is gone.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from airflow_idempotency.runner import RunContext, run_idempotently
from support.db import rows
from support.locks import Background, terminate_lock_session, wait_for

JOB = "finding"
KEY = "2026-10-01"


def test_a_start_after_its_lock_was_lost_does_not_take_the_run_over(pg_dsn: str) -> None:
    late_start, successor_works = threading.Event(), threading.Event()
    connects = {"late": 0}

    def late_connect() -> psycopg.Connection[Any]:
        connects["late"] += 1
        if connects["late"] == 2:  # the work connection: opened after the lock is taken
            late_start.wait(30)
        return psycopg.connect(pg_dsn)

    def successor_work(run: RunContext) -> None:
        successor_works.set()
        with run.transaction() as cur:
            cur.execute("CREATE TABLE IF NOT EXISTS finding_rows (n int)")
            cur.execute("INSERT INTO finding_rows VALUES (1)")
        wait_for("the late start", lambda: late.error is not None or late.result is not None)

    late = Background(
        lambda: run_idempotently(
            connect=late_connect, job_name=JOB, run_key=KEY, work=lambda run: None
        )
    )
    wait_for("the first attempt's lock", lambda: connects["late"] == 2)
    terminate_lock_session(pg_dsn, JOB, KEY)  # its lock session ends before its start
    successor = Background(
        lambda: run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn), job_name=JOB, run_key=KEY, work=successor_work
        )
    )
    assert successor_works.wait(30), "the successor did not start its work"
    late_start.set()  # the lost attempt's start goes on now
    late.join()
    successor.join()
    # the successor's write committed: the successor must be the run's completed attempt
    assert rows(pg_dsn, "SELECT n FROM finding_rows") == [(1,)]
    assert successor.error is None, successor.error
    assert rows(pg_dsn, "SELECT status FROM idempotency.job_runs") == [("completed",)]
