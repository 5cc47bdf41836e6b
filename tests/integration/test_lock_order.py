"""Row locks of the bookkeeping are taken in one order: the run (job_runs) before its attempts.

A successor's start (sql: start_attempt) locks the key's job_runs row FOR UPDATE (it reads the
run again after its take-over's wait), then closes the running attempts it finds as abandoned.
A failing attempt writes its failure at the same moment: if it closed its attempt first and
then touched the run, each would wait for the other (PostgreSQL's deadlock detector then kills
one after deadlock_timeout: found by CI in tests/faults/test_faults_fence.py, where the
successor lost). Here a session does what the successor's start does, in that order, while a
real run records its failure, in both lock modes: nobody waits on anybody twice.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from airflow_idempotency.runner import RunContext, run_idempotently
from support.db import rows
from support.locks import ROW_LOCKS, Background, lock_waiters, wait_for

JOB, KEY = "lock_order_job", "2026-12-01"


def test_a_failure_written_while_a_successor_starts_never_deadlocks(
    pg_dsn: str, lock_mode: str
) -> None:
    inside, go = threading.Event(), threading.Event()

    def fails(ctx: RunContext) -> None:
        inside.set()
        assert go.wait(30)
        raise RuntimeError("the work failed")

    first = Background(
        lambda: run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn), job_name=JOB, run_key=KEY, work=fails
        )
    )
    assert inside.wait(30)
    ((attempt_id,),) = rows(
        pg_dsn,
        "SELECT attempt_id FROM idempotency.job_run_attempts WHERE run_key = %s",
        (KEY,),
    )
    with psycopg.connect(pg_dsn) as successor:
        # the start's first row lock: the run, FOR UPDATE
        successor.execute(
            "SELECT 1 FROM idempotency.job_runs WHERE job_name = %s AND run_key = %s FOR UPDATE",
            (JOB, KEY),
        )
        go.set()
        wait_for(
            "the failure to wait for the run's row",
            lambda: bool(lock_waiters(pg_dsn, ROW_LOCKS)),
        )
        # then its second: the running attempt, closed as abandoned. It must not wait for the
        # failing attempt (which waits for this session): bounded below deadlock_timeout (1 s),
        # so that a wait fails here rather than one side being killed by the detector
        successor.execute("SET lock_timeout = '500ms'")
        successor.execute(
            "UPDATE idempotency.job_run_attempts SET details = details || '{\"seen\": 1}' "
            "WHERE attempt_id = %s",
            (attempt_id,),
        )
        successor.commit()
    first.join(30)
    assert isinstance(first.error, RuntimeError), first.error
    outcome: Any = rows(
        pg_dsn,
        "SELECT outcome, details ->> 'seen' FROM idempotency.job_run_attempts "
        "WHERE attempt_id = %s",
        (attempt_id,),
    )[0]
    assert outcome == ("failed", "1")
    ((status,),) = rows(
        pg_dsn, "SELECT status FROM idempotency.job_runs WHERE run_key = %s", (KEY,)
    )
    assert status == "failed"
