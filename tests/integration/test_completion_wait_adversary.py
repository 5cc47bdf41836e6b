"""An adversary's pass over the lease mode's completion that waits for a connection slot
(run_context.connect_when_room, lease_run.LeaseRun._completion_connect; issue 32). Each test is
one attack on a database of its own: a failing test is a defect found (its docstring says what
breaks); a passing one is an attack that held.

Tried and held (no test here but the takeover's, see the pass's note): the retry commits
once; a key taken over while the completion waits (its heartbeat refused too, the lease
expired) is refused by the fence; no password of the DSN reaches the log line; an error that
is not a slot refusal is not retried; PgBouncer's max_client_conn is waited out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg_pool import ConnectionPool

from airflow_idempotency import RunOutcome, run_idempotently
from airflow_idempotency.exceptions import LockLostError, PoolExhaustedError
from airflow_idempotency.leases import LockMode
from airflow_idempotency.locks import LOCK_WAIT_ENV
from airflow_idempotency.run_context import connect_when_room
from support.db import rows


@pytest.fixture
def no_slot_dsn(pg_dsn: str) -> Iterator[str]:
    """The test database as a role of CONNECTION LIMIT 0: PostgreSQL refuses every connection
    of it for want of a slot ("too many connections for role")."""
    role = f"adv_noslot_{uuid.uuid4().hex[:8]}"
    rows(pg_dsn, f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 0')
    try:
        yield make_conninfo(pg_dsn, user=role)
    finally:
        rows(pg_dsn, f'DROP ROLE "{role}"')


def test_the_slot_wait_ends_at_its_bound(no_slot_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """connect_when_room pauses "for at most ``seconds`` in all" (its docstring; docs/deploying.md:
    "for at most the lock wait"). Broke: tenacity's stop_after_delay is checked after each try,
    and the pause before the next try was not cut to what was left: refused for good, a 1 s
    bound paused up to 1.8 s in all (a pause of up to 1 s past the bound, then one more try)."""
    bound = 1.0
    monkeypatch.setenv(LOCK_WAIT_ENV, str(bound))  # the bound of every lock wait, and of this
    for _ in range(5):
        paused: list[float] = []
        connection = connect_when_room(
            lambda: psycopg.connect(no_slot_dsn), "a test", logging.getLogger(__name__),
            paused.append,
        )  # fmt: skip
        began = time.monotonic()
        refused = pytest.raises(psycopg.OperationalError, match="too many connections for role")
        with refused, connection():
            pass
        took = time.monotonic() - began
        assert paused and paused[0] <= took, paused  # the whole wait, its tries too (adv33a)
        assert took <= bound + 0.25, took


def _pool_and_connect(
    dsn: str, free_after: float
) -> tuple[ConnectionPool, threading.Event, list[threading.Timer], Any]:
    """A pool of 2 connections whose every connection is taken by the test just before the
    completion asks for one (the first connection after the work), given back ``free_after``
    seconds later; its getconn gives up after 0.5 s (PoolTimeout)."""
    pool = ConnectionPool(dsn, min_size=2, max_size=2, timeout=0.5, open=True)
    pool.wait()
    worked = threading.Event()
    timers: list[threading.Timer] = []

    def connect() -> Any:
        if worked.is_set() and not timers:
            taken = [pool.getconn(), pool.getconn()]

            def give_back() -> None:
                for conn in taken:
                    pool.putconn(conn)

            timers.append(threading.Timer(free_after, give_back))
            timers[0].start()
        return pool.connection()

    return pool, worked, timers, connect


def _work(worked: threading.Event) -> Any:
    def work(run: Any) -> dict[str, int]:
        with run.transaction() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS done (k text)")
            conn.execute("INSERT INTO done VALUES ('x')")
        worked.set()
        return {"done": 1}

    return work


def test_a_pools_timeout_at_the_completion_waits_for_a_slot(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's ``connect`` is a psycopg_pool's ``connection`` (as bench/decision.py and
    test_decision_round_trips run it): the completion finds the pool exhausted for 1.5 s, its
    getconn gives up after 0.5 s (PoolTimeout, nothing of it sent). Broke: PoolTimeout was not
    a want of a slot, so the completion did not wait: the run failed at once with a
    LockLostError saying "the connection was lost", recorded lock_lost (nobody had taken the
    key), and the rerun did the committed work again. Now it waits, as for PostgreSQL's
    refusal, and completes with the work once."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "5")
    pool, worked, timers, connect = _pool_and_connect(pg_dsn, free_after=1.5)
    try:
        result = run_idempotently(
            connect=connect, job_name="job", run_key="2026-10-05", work=_work(worked),
            lock_mode="lease",
        )  # fmt: skip
    finally:
        for timer in timers:
            timer.join()
        pool.close()
    assert timers, "the completion's connection was not the one refused"
    assert result.outcome is RunOutcome.COMPLETED
    assert rows(pg_dsn, "SELECT count(*) FROM done") == [(1,)]
    status = "SELECT status FROM idempotency.job_runs WHERE run_key = '2026-10-05'"
    assert rows(pg_dsn, status) == [("completed",)]


def test_a_pools_timeout_past_the_bound_names_the_sizing_rule(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool stays exhausted past the bound (the lock wait, 1 s): the run fails with
    PoolExhaustedError naming the pool and the sizing rule. Broke: a LockLostError saying the
    connection was lost, the attempt recorded lock_lost though no one had taken the key."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")
    pool, worked, timers, connect = _pool_and_connect(pg_dsn, free_after=4)
    try:
        with pytest.raises(PoolExhaustedError) as refused:
            run_idempotently(
                connect=connect, job_name="job", run_key="2026-10-06", work=_work(worked),
                lock_mode="lease",
            )  # fmt: skip
    finally:
        for timer in timers:
            timer.join()
        pool.close()
    said = str(refused.value)
    assert "pool" in said and "docs/deploying.md" in said, said
    assert "lost" not in said, said


@pytest.fixture
def role_of_four(pg_dsn: str) -> Iterator[str]:
    """The test database as a role (not a superuser) of CONNECTION LIMIT 4, the bookkeeping
    schema made and ``public.done`` (the work's table) granted to it."""
    role = f"adv_four_{uuid.uuid4().hex[:8]}"
    rows(pg_dsn, f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 4')
    run_idempotently(  # the bookkeeping schema, made as the test's superuser
        connect=lambda: psycopg.connect(pg_dsn), job_name="setup", run_key="k", work=lambda r: None
    )
    rows(pg_dsn, "CREATE TABLE public.done (who text NOT NULL)")
    for grant in (
        "ALL ON SCHEMA idempotency",
        "ALL ON ALL TABLES IN SCHEMA idempotency",
        "ALL ON ALL SEQUENCES IN SCHEMA idempotency",
        "ALL ON public.done",
    ):
        rows(pg_dsn, f'GRANT {grant} TO "{role}"')
    try:
        yield make_conninfo(pg_dsn, user=role)
    finally:
        rows(pg_dsn, f'DROP OWNED BY "{role}"')
        rows(pg_dsn, f'DROP ROLE "{role}"')


def test_a_key_taken_over_while_the_completion_waits_is_refused_its_completion(
    role_of_four: str, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held. A's work is committed; its completion, and its heartbeat, are refused every
    connection (the role's 4 slots taken by the test), so its lease (ttl 2 s) expires. Worker B,
    on the test's connections, takes the key over and, in the middle of its work, gives the
    slots back: A's completion gets its connection while B holds the key, and the fence refuses
    it (LockLostError, nothing of A's completion committed); B completes the key."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "15")
    held: list[psycopg.Connection] = []
    guard = threading.Lock()
    worked, taken = threading.Event(), threading.Event()
    results: list[Any] = []

    @contextlib.contextmanager
    def lend() -> Iterator[psycopg.Connection]:
        with guard:
            conn = held.pop()
        try:
            yield conn
        finally:
            with guard:
                held.append(conn)

    def give_back() -> None:
        with guard:
            for conn in held:
                conn.close()
            held.clear()

    def work_of(who: str) -> Any:
        def work(run: Any) -> dict[str, int]:
            with run.transaction() as conn:
                conn.execute("INSERT INTO public.done VALUES (%s)", (who,))
            if who == "A":
                worked.set()
            else:
                give_back()  # A's completion connects while B holds the key
                time.sleep(2)
            return {"done": 1}

        return work

    def run_b() -> None:
        time.sleep(3.5)  # A's lease (ttl 2 s) has expired: its renewals were refused
        try:
            done = run_idempotently(
                connect=lend, job_name="job", run_key="2026-10-07", work=work_of("B"),
                lock_mode=LockMode("lease", 2),
            )  # fmt: skip
        except BaseException as exc:
            results.append(exc)
        else:
            results.append(done.outcome)

    b = threading.Thread(target=run_b)

    def connect_a() -> psycopg.Connection:
        if worked.is_set() and not taken.is_set():  # the completion's connection
            taken.set()
            with contextlib.suppress(psycopg.OperationalError):
                while True:
                    held.append(psycopg.connect(role_of_four, autocommit=True))
            b.start()
        return psycopg.connect(role_of_four)

    try:
        with pytest.raises(LockLostError):
            run_idempotently(
                connect=connect_a, job_name="job", run_key="2026-10-07", work=work_of("A"),
                lock_mode=LockMode("lease", 2),
            )  # fmt: skip
    finally:
        if b.is_alive() or taken.is_set():
            b.join(30)
        give_back()
    assert len(held) == 0 and taken.is_set()
    assert results == [RunOutcome.COMPLETED]
    attempts = rows(
        pg_dsn,
        "SELECT a.outcome, a.attempt_id = j.current_attempt_id FROM idempotency.job_run_attempts"
        " AS a JOIN idempotency.job_runs AS j USING (job_name, run_key)"
        " WHERE a.run_key = '2026-10-07' ORDER BY a.attempt_id",
    )
    assert attempts == [("lock_lost", False), ("completed", True)], attempts
    assert rows(pg_dsn, "SELECT who FROM public.done ORDER BY who") == [("A",), ("B",)]
