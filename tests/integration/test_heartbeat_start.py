"""The lease's heartbeat thread starts when its first renewal is due (issue 32, goal 4): a run
done within ``lease_ttl / 3`` starts no thread, a longer one renews from a thread of its own,
and a heartbeat stopped as its first renewal falls due starts none and renews nothing after.
On a real PostgreSQL, through run_idempotently and LeaseHeartbeat themselves."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_idempotency.leases import LeaseHeartbeat, LockMode, acquire_lease
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.runner import RunContext, RunOutcome, RunResult, run_idempotently

JOB = "heartbeat_job"


@pytest.fixture
def db(adv_db: str) -> str:
    """A fresh database with the bookkeeping schema (the integration tests' shared one)."""
    return adv_db


def heartbeat_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("lease-heartbeat-")]


def run_leased(db: str, key: str, work: Any, ttl: float) -> RunResult:
    """One lease-mode run of the test's job for ``key``, its lease living ``ttl`` seconds."""
    return run_idempotently(
        connect=lambda: psycopg.connect(db),
        job_name=JOB,
        run_key=key,
        work=work,
        lock_mode=LockMode("lease", lease_ttl=ttl),
    )


def test_a_run_done_before_its_first_renewal_starts_no_heartbeat_thread(db: str) -> None:
    seen: list[list[str]] = []

    def work(ctx: RunContext) -> dict[str, int]:
        seen.append(heartbeat_threads())
        return {"n": 1}

    before = {t.ident for t in threading.enumerate()}
    for day in range(1, 6):
        result = run_leased(db, f"2026-10-0{day}", work, ttl=30)
        assert result.outcome is RunOutcome.COMPLETED
    assert seen == [[]] * 5, "a heartbeat thread was started before its first renewal was due"
    # the process's watch threads at most (the start's, the leases'), whatever the number of runs
    new = {t.name for t in threading.enumerate() if t.ident not in before}
    assert new <= {"airflow-idempotency-watch", "airflow-idempotency-lease-watch"}
    assert heartbeat_threads() == []


def test_a_run_longer_than_its_first_renewal_renews_from_a_thread_of_its_own(db: str) -> None:
    key = "2026-10-01"
    lock_key = run_lock_key(JOB, key)
    seen: dict[str, Any] = {}

    def lease_row() -> tuple[Any, Any]:
        with psycopg.connect(db) as conn:
            row = conn.execute(
                "SELECT renewed_at, expires_at FROM idempotency.run_leases WHERE lock_key = %s",
                (lock_key,),
            ).fetchone()
        assert row is not None
        return row[0], row[1]

    def work(ctx: RunContext) -> dict[str, int]:
        seen["taken"] = lease_row()
        seen["early"] = heartbeat_threads()
        deadline = time.monotonic() + 5
        while lease_row()[0] == seen["taken"][0] and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["renewed"] = lease_row()
        seen["late"] = heartbeat_threads()
        return {"n": 1}

    result = run_leased(db, key, work, ttl=1.2)
    assert result.outcome is RunOutcome.COMPLETED
    assert seen["early"] == []
    assert seen["renewed"][0] > seen["taken"][0], "the lease was not renewed within 5 s"
    assert seen["renewed"][1] > seen["taken"][1]
    assert seen["late"] == [f"lease-heartbeat-{lock_key}"]
    assert heartbeat_threads() == [], "the run's heartbeat thread outlived it"


def test_a_heartbeat_stopped_as_its_first_renewal_falls_due_renews_nothing_after(
    db: str,
) -> None:
    """Stop races the watch's start of the thread: whichever wins, no renewal borrows a
    connection once stop() has returned, and no heartbeat thread is left."""
    rng = random.Random(32)
    borrowed_after_stop: list[int] = []
    renewals = 0
    for i in range(60):
        lock_key = run_lock_key(JOB, f"race-{i}")
        with psycopg.connect(db, autocommit=True) as conn:
            lock = acquire_lease(conn, lock_key, schema="idempotency", ttl=30)
        assert lock is not None and lock.lost is not None
        stopped = threading.Event()

        @contextlib.contextmanager
        def borrow(
            stopped: threading.Event = stopped, i: int = i
        ) -> Iterator[psycopg.Connection[Any]]:
            nonlocal renewals
            renewals += 1
            if stopped.is_set():
                borrowed_after_stop.append(i)
            with psycopg.connect(db, autocommit=True) as conn:
                yield conn

        beat = LeaseHeartbeat(lock, borrow, schema="idempotency", ttl=0.03)  # due at 10 ms
        beat.start()
        time.sleep(rng.uniform(0.0, 0.03))
        beat.stop()
        stopped.set()
    time.sleep(0.1)
    assert borrowed_after_stop == []
    assert heartbeat_threads() == []
    assert renewals > 0, "no heartbeat ever renewed: the race was not exercised"


def test_a_run_whose_heartbeat_thread_cannot_start_keeps_its_lease(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process at its thread limit when the first renewal falls due (adv33a): the run's lease
    is still renewed, so another worker polling for the key never takes it over while the run
    lives, and the run completes. (It was left unrenewed: taken over after ``lease_ttl``, the
    run's completion refused, its work done twice.)"""
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name.startswith("lease-heartbeat-"):
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    key = "2026-10-02"
    lock_key = run_lock_key(JOB, key)
    taken_over: list[object] = []

    def work(ctx: RunContext) -> dict[str, int]:
        deadline = time.monotonic() + 3.5  # almost three lease_ttl
        while time.monotonic() < deadline:
            with psycopg.connect(db, autocommit=True) as conn:
                other = acquire_lease(conn, lock_key, schema="idempotency", ttl=30)
            if other is not None:
                taken_over.append(other)
                break
            time.sleep(0.1)
        return {"n": 1}

    result = run_leased(db, key, work, ttl=1.2)
    assert taken_over == [], "another worker took the lease of a live run over"
    assert result.outcome is RunOutcome.COMPLETED
