"""Past ``max_connections``: a run refused a connection fails with an error naming the sizing
rule, its attempt recorded when it had a connection to record it on, and a retry converges.

A PRIVATE embedded PostgreSQL (devtools.postgres.private_embedded) with a small
``max_connections``, its every slot then taken by idle connections of the test: nobody else's
server runs out of connections.

In the lease mode (``test_lease_mode_*``) a run borrows one connection at a time (the decision,
the start, the work's transactions, the completion): no slot at all is refused the same way,
nothing recorded; a single free slot is enough for a run whose work opens no connection of
its own to complete.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_idempotency import RunOutcome, run_idempotently
from airflow_idempotency.exceptions import PoolExhaustedError
from airflow_idempotency.locks import LOCK_WAIT_ENV
from devtools.postgres import PostgresServer, private_embedded
from support.db import rows
from support.faults import figures, refusal

pytestmark = pytest.mark.slow

MAX_CONNECTIONS = 10


@pytest.fixture
def small_server() -> Iterator[tuple[PostgresServer, str]]:
    """A private server with MAX_CONNECTIONS slots (none reserved) and a migrated database."""
    with private_embedded("overload") as server:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET max_connections = {MAX_CONNECTIONS}")
            conn.execute("ALTER SYSTEM SET superuser_reserved_connections = 0")
        server.restart()
        dsn = server.dsn(server.create_database("overload"))
        run_idempotently(  # the bookkeeping schema, made while slots are free
            connect=lambda: psycopg.connect(dsn), job_name="setup", run_key="k", work=lambda r: None
        )
        yield server, dsn


@contextlib.contextmanager
def every_slot_taken(dsn: str, leave_free: int = 0) -> Iterator[list[psycopg.Connection]]:
    """Idle connections in every slot of the server but ``leave_free``; closed afterwards."""
    held: list[psycopg.Connection] = []
    try:
        while True:
            try:
                held.append(psycopg.connect(dsn, autocommit=True))
            except psycopg.OperationalError as exc:
                assert "too many clients" in str(exc), exc
                break
        for _ in range(leave_free):
            held.pop().close()
        yield held
    finally:
        for conn in held:
            conn.close()


def attempt(dsn: str, run_key: str, lock_mode: str = "advisory") -> BaseException:
    with pytest.raises(PoolExhaustedError) as refused:
        run_idempotently(
            connect=lambda: psycopg.connect(dsn), job_name="job", run_key=run_key,
            work=lambda run: {"done": 1}, lock_mode=lock_mode,
        )  # fmt: skip
    return refused.value


def test_past_max_connections_the_run_names_the_sizing_rule_and_records_its_attempt(
    small_server: Any,
) -> None:
    """No slot at all: the run fails with PoolExhaustedError naming the sizing rule (docs/deploying.md), nothing could be recorded; one slot (its lock's): the work's connection is refused, the attempt is recorded failed with the same message; with slots free again the key completes."""
    _, dsn = small_server
    with every_slot_taken(dsn) as held:
        none_free = attempt(dsn, "2026-10-01")
    with every_slot_taken(dsn, leave_free=1):
        one_free = attempt(dsn, "2026-10-02")
    for error in (none_free, one_free):
        assert "docs/deploying.md" in str(error) and "max_connections" in str(error)
        assert "too many clients already" in str(error)
    recorded = rows(
        dsn,
        "SELECT run_key, outcome, error FROM idempotency.job_run_attempts"
        " WHERE job_name = 'job' ORDER BY attempt_id",
    )
    assert [(k, o) for k, o, _ in recorded] == [("2026-10-02", "failed")]
    assert "max_connections" in recorded[0][2]
    for key in ("2026-10-01", "2026-10-02"):
        done = run_idempotently(
            connect=lambda: psycopg.connect(dsn), job_name="job", run_key=key,
            work=lambda run: {"done": 1},
        )  # fmt: skip
        assert done.outcome.value == "completed"
    figures(
        f"max_connections {MAX_CONNECTIONS}, {len(held)} taken by the test: no slot: "
        f"{refusal(none_free)} (nothing recorded); one slot: the attempt recorded failed; "
        "both keys completed once slots were free"
    )


def test_lease_mode_past_max_connections_no_slot_is_refused_and_one_slot_is_enough(
    small_server: Any,
) -> None:
    """The lease mode: no slot at all fails with PoolExhaustedError naming the sizing rule, nothing recorded; a single free slot is enough: the run borrows one connection at a time and completes."""
    _, dsn = small_server
    with every_slot_taken(dsn) as held:
        none_free = attempt(dsn, "2026-10-01", lock_mode="lease")
    assert "max_connections" in str(none_free) and "too many clients already" in str(none_free)
    sql = "SELECT count(*) FROM idempotency.job_run_attempts WHERE job_name = 'job'"
    assert rows(dsn, sql) == [(0,)]
    with every_slot_taken(dsn, leave_free=1):
        done = run_idempotently(
            connect=lambda: psycopg.connect(dsn), job_name="job", run_key="2026-10-02",
            work=lambda run: {"done": 1}, lock_mode="lease",
        )  # fmt: skip
    assert done.outcome.value == "completed"
    leased = (
        "SELECT lock_backend_pid IS NULL FROM idempotency.job_run_attempts WHERE job_name = 'job'"
    )
    assert rows(dsn, leased) == [(True,)]  # a lease: no lock session recorded
    figures(
        f"lease mode, max_connections {MAX_CONNECTIONS}, {len(held)} taken by the test: no "
        f"slot: {refusal(none_free)} (nothing recorded); one slot: the run completed"
    )


def test_lease_mode_a_completion_refused_a_connection_names_the_sizing_rule(
    small_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease mode's completion borrows a connection of its own after the work: refused one
    (PostgreSQL has no slot left) for longer than the bound of its wait (the lock wait, 2 s
    here), the run fails with PoolExhaustedError naming the sizing rule, not with a
    LockLostError saying the connection was lost (the scale benchmark's direct lease cell at
    N=1,000: 28 runs so named, nobody had taken their keys). The job's connect callable takes
    every free slot just before the completion's connection is opened."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "2")
    _, dsn = small_server
    worked = threading.Event()
    held: list[psycopg.Connection] = []

    def connect() -> psycopg.Connection:
        if worked.is_set() and not held:  # the first connection after the work: the completion's
            with every_slot_taken(dsn) as taken:
                held.extend(taken)
                taken.clear()  # kept open until the test ends
        return psycopg.connect(dsn)

    def work(run: Any) -> dict[str, int]:
        worked.set()
        return {"done": 1}

    caplog.set_level(logging.WARNING)
    began = time.monotonic()
    try:
        with pytest.raises(PoolExhaustedError) as refused:
            run_idempotently(
                connect=connect, job_name="job", run_key="2026-10-03", work=work,
                lock_mode="lease",
            )  # fmt: skip
    finally:
        for conn in held:
            conn.close()
    assert time.monotonic() - began >= 2  # it waited its bound for a slot first
    said = str(refused.value)
    assert held, "the completion's connection was not the one refused"
    assert "max_connections" in said and "too many clients already" in said, said
    completed = "SELECT status FROM idempotency.job_runs WHERE run_key = '2026-10-03'"
    assert rows(dsn, completed) == [("started",)]  # not marked completed: a rerun converges
    gave_up = [r.getMessage() for r in caplog.records if "giving up" in r.getMessage()]
    assert len(gave_up) == 1 and LOCK_WAIT_ENV in gave_up[0], gave_up
    assert re.search(r"after [234]\.\d s of waiting", gave_up[0]), gave_up  # its bound, 2 s
    figures(f"lease mode, the completion refused a connection: {refusal(refused.value)}")


def test_lease_mode_a_completion_refused_a_connection_waits_for_a_slot_and_completes(
    small_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The completion refused a connection for want of a slot waits for one (its work is
    committed: failing now would make the rerun do it again), says so, and completes once a
    slot is free (here 1.5 s later): the work committed once, the run completed, one attempt."""
    _, dsn = small_server
    worked = threading.Event()
    held: list[psycopg.Connection] = []
    freed: list[threading.Timer] = []

    def free_slots() -> None:
        for conn in held:
            conn.close()

    def connect() -> psycopg.Connection:
        if worked.is_set() and not held:  # the first connection after the work: the completion's
            with every_slot_taken(dsn) as taken:
                held.extend(taken)
                taken.clear()
            freed.append(threading.Timer(1.5, free_slots))
            freed[0].start()
        return psycopg.connect(dsn)

    def work(run: Any) -> dict[str, int]:
        with run.transaction() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS done (k text)")
            conn.execute("INSERT INTO done VALUES ('2026-10-04')")
        worked.set()
        return {"done": 1}

    caplog.set_level(logging.WARNING)
    try:
        result = run_idempotently(
            connect=connect, job_name="job", run_key="2026-10-04", work=work, lock_mode="lease"
        )
    finally:
        for timer in freed:
            timer.join()
        free_slots()
    assert held, "the completion's connection was not the one refused"
    assert result.outcome is RunOutcome.COMPLETED
    assert rows(dsn, "SELECT count(*) FROM done") == [(1,)]
    assert rows(dsn, "SELECT status FROM idempotency.job_runs WHERE run_key = '2026-10-04'") == [
        ("completed",)
    ]
    said = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(said) == 1 and "too many clients already" in said[0], said
    figures(f"lease mode, the completion refused a connection for 1.5 s: waited, {said[0]}")


@pytest.mark.parametrize("lock_mode", ["advisory", "lease"])
def test_the_ledgers_connection_refused_after_the_work_waits_for_a_slot(
    small_server: Any, caplog: pytest.LogCaptureFixture, lock_mode: str
) -> None:
    """The outbound ledger's connection (``run.bookkeeping_connection()``), opened after the
    work committed, refused for want of a slot for 1.5 s: it waits for one, says so, and the run
    completes with its work committed once (the issue's case: a run that failed at the ledger's
    connection had already committed its work, so its retry did the work again)."""
    _, dsn = small_server
    timers: list[threading.Timer] = []
    held: list[psycopg.Connection] = []

    def free_slots() -> None:
        for conn in held:
            conn.close()

    def work(run: Any) -> dict[str, int]:
        with run.transaction() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS done (k text)")
            conn.execute("INSERT INTO done VALUES (%s)", (run.run_key,))
        with every_slot_taken(dsn) as taken:
            held.extend(taken)
            taken.clear()
        timers.append(threading.Timer(1.5, free_slots))
        timers[0].start()
        with run.bookkeeping_connection() as conn:
            conn.execute("SELECT 1")
        return {"done": 1}

    caplog.set_level(logging.WARNING)
    key = f"2026-10-0{5 if lock_mode == 'advisory' else 6}"
    try:
        result = run_idempotently(
            connect=lambda: psycopg.connect(dsn), job_name="job", run_key=key, work=work,
            lock_mode=lock_mode,
        )  # fmt: skip
    finally:
        for timer in timers:
            timer.join()
        free_slots()
    assert held, "no slot was taken"
    assert result.outcome is RunOutcome.COMPLETED
    assert rows(dsn, "SELECT count(*) FROM done WHERE k = %s", (key,)) == [(1,)]
    said = [
        r.getMessage() for r in caplog.records if "refused the outbound ledger" in r.getMessage()
    ]
    assert len(said) == 1 and "too many clients already" in said[0], said
    figures(
        f"{lock_mode}: the ledger's connection refused for 1.5 s after the work: waited, completed"
    )
