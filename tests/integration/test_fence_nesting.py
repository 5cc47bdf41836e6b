"""The fence however transactions nest or follow each other, on a real PostgreSQL (issue 30):
a fenced transaction inside the work's own psycopg transaction and around savepoints, a COMMIT
of the work's own inside the block, a lost attempt's later transactions, a holder whose pid
was reused, two-phase commit; in both lock modes where they apply (the ``lock_mode``
fixture). (The ledger and OutputFile inside ``run.transaction()`` of a
lost attempt, and the bounded takeover: tests/faults/test_faults_fence.py.)"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from airflow_idempotency.exceptions import LockLostError, LockWaitError, TransactionMisuseError
from airflow_idempotency.fence import Fence
from airflow_idempotency.ledger import OutboundLedger
from airflow_idempotency.ledger.senders import Effect
from airflow_idempotency.locks import LOCK_WAIT_ENV, RunLock, run_lock_key
from airflow_idempotency.runner import RunContext, RunOutcome, RunResult, run_idempotently
from devtools.postgres import PostgresServer, private_embedded, temporary_database
from support.db import rows
from support.fenced_work import Recorder, insert, outcomes, writer, written
from support.locks import (
    Background,
    run_lock_holder,
    terminate_lock_session,
    wait_for,
)

JOB, KEY = "nested_job", "2026-10-01"


def run(dsn: str, work: Callable[[RunContext], Any], **connect: Any) -> RunResult:
    return run_idempotently(
        connect=lambda: psycopg.connect(dsn, **connect), job_name=JOB, run_key=KEY, work=work
    )


def test_a_fenced_transaction_inside_the_works_own_transaction_is_checked_at_its_commit(
    facts: str, lock_mode: str
) -> None:
    """Defect 2: run.transaction() inside the connection's own psycopg transaction (idiomatic
    psycopg 3) is a savepoint whose check runs at that transaction's COMMIT: the lock lost
    before it, nothing commits, and the attempt ends lock_lost."""

    def work(ctx: RunContext) -> None:
        with ctx.connection.transaction():
            with ctx.transaction() as cur:
                insert(cur, "old")
            terminate_lock_session(facts, JOB, KEY)

    with pytest.raises(LockLostError, match="was lost before this transaction"):
        run(facts, work)
    assert written(facts) == []
    assert outcomes(facts) == ["lock_lost"]
    assert run(facts, writer("rerun")).outcome is RunOutcome.COMPLETED
    assert written(facts) == ["rerun"]


@pytest.mark.parametrize("where", ["before", "inside"])
def test_set_constraints_immediate_cannot_run_the_commit_check_early(
    facts: str, where: str, lock_mode: str
) -> None:
    """SET CONSTRAINTS ALL IMMEDIATE in the work's own transaction (before run.transaction(),
    or inside it) would fire the fence's deferred check at once, leaving the real COMMIT
    unchecked: the lock lost after the block, nothing of the work may commit (adversary,
    issue 30: the row landed)."""

    def work(ctx: RunContext) -> None:
        with ctx.connection.transaction():
            if where == "before":
                ctx.connection.execute("SET CONSTRAINTS ALL IMMEDIATE")
            with ctx.transaction() as cur:
                insert(cur, "old")
                if where == "inside":
                    cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
            terminate_lock_session(facts, JOB, KEY)

    with pytest.raises((LockLostError, TransactionMisuseError)):
        run(facts, work)
    assert written(facts) == []


def test_savepoints_inside_a_fenced_transaction_commit_only_under_the_lock(
    facts: str, lock_mode: str
) -> None:
    """Savepoints of the work's own inside run.transaction() (and one around a second
    run.transaction()): what they keep commits with the fenced transaction, and nothing of it
    once the lock is lost before the COMMIT."""

    def work(ctx: RunContext) -> None:
        with ctx.transaction() as cur:
            with ctx.connection.transaction():
                insert(cur, "kept")
            with pytest.raises(ZeroDivisionError), ctx.connection.transaction():
                insert(cur, "rolled back")
                raise ZeroDivisionError
            with ctx.transaction() as inner:
                insert(inner, "nested")
            terminate_lock_session(facts, JOB, KEY)

    with pytest.raises(LockLostError):
        run(facts, work)
    assert written(facts) == []


def test_a_commit_of_the_works_own_inside_the_block_is_fenced_and_refused(
    facts: str, lock_mode: str
) -> None:
    """A COMMIT the work sends itself inside run.transaction() is checked (the check is armed
    when the transaction begins): after the lock is lost it does not commit. With the lock held
    it commits, and the block then fails clearly: what follows it would run unfenced."""

    def lost(ctx: RunContext) -> None:
        with ctx.transaction() as cur:
            insert(cur, "old")
            terminate_lock_session(facts, JOB, KEY)
            cur.execute("COMMIT")

    with pytest.raises(LockLostError):
        run(facts, lost)
    assert written(facts) == []

    def held(ctx: RunContext) -> None:
        with ctx.transaction() as cur:
            insert(cur, "committed by the work")
            cur.execute("COMMIT")

    with pytest.raises(TransactionMisuseError, match="ended its fenced transaction"):
        run(facts, held)
    assert written(facts) == ["committed by the work"]


def test_every_later_transaction_of_a_lost_attempt_is_refused(facts: str, lock_mode: str) -> None:
    """After its lock is lost and a successor has completed the key, the old attempt's second
    and third fenced transactions (the work's, then the ledger's claim) are refused one after
    the other; only its first, committed under the lock, and the successor's writes land."""
    first_done, go = threading.Event(), threading.Event()
    refused: list[str] = []
    remote = Recorder()

    def old_work(ctx: RunContext) -> None:
        with ctx.transaction() as cur:
            insert(cur, "old 1")
        first_done.set()
        assert go.wait(30)
        for name in ("old 2", "old 3"):
            with pytest.raises(LockLostError), ctx.transaction() as cur:
                insert(cur, name)
            refused.append(name)
        with pytest.raises(LockLostError):
            OutboundLedger(ctx, "remote").send_all([Effect("k1", {"n": 1})], remote)
        refused.append("claim")

    old = Background(lambda: run(facts, old_work))
    assert first_done.wait(30)
    terminate_lock_session(facts, JOB, KEY)
    assert run(facts, writer("new")).outcome is RunOutcome.COMPLETED
    go.set()
    assert old.join(20).error is not None
    assert refused == ["old 2", "old 3", "claim"] and remote.calls == []
    assert written(facts) == ["new", "old 1"]


def test_a_holder_whose_pid_was_reused_is_not_the_holder(facts: str) -> None:
    """The fence names the lock transaction, not only its backend pid: a fence that names the
    successor's pid (as after the operating system reused the lost session's pid) but the lost
    lock transaction is refused, at its first statement and at COMMIT alike."""
    lost: dict[str, Any] = {}
    go = threading.Event()

    def old_work(ctx: RunContext) -> None:
        lost["lock"] = ctx._lock  # the attempt's own view of its lock (the test reads it)
        lost["attempt"] = ctx.attempt_id
        assert go.wait(30)

    old = Background(lambda: run(facts, old_work))
    wait_for("the old attempt's work", lambda: "lock" in lost)
    terminate_lock_session(facts, JOB, KEY)
    successor_started = threading.Event()
    release = threading.Event()

    def new_work(ctx: RunContext) -> None:
        successor_started.set()
        assert release.wait(30)

    new = Background(lambda: run(facts, new_work))
    assert successor_started.wait(30)
    reused_pid = run_lock_holder(facts, JOB, KEY)
    assert reused_pid is not None and lost["lock"].holder
    forged = RunLock(run_lock_key(JOB, KEY), reused_pid, lost["lock"].holder)
    fence = Fence(forged, lost["attempt"], "idempotency", JOB, KEY)
    with psycopg.connect(facts, autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as refused, fence.transaction(conn):
            conn.execute("INSERT INTO public.facts VALUES ('forged')")
        assert isinstance(fence.translate_error(refused.value, conn), LockLostError)
        with pytest.raises(psycopg.Error, match="was lost before"), conn.transaction():
            conn.execute(
                "INSERT INTO idempotency.fence_arms"
                " (lock_key, lock_backend_pid, lock_holder, attempt_id) VALUES (%s, %s, %s, %s)",
                (forged.lock_key, reused_pid, forged.holder, lost["attempt"]),
            )
            conn.execute("INSERT INTO public.facts VALUES ('forged at commit')")
    release.set()
    go.set()
    assert new.join(20).error is None
    assert isinstance(old.join(20).error, LockLostError)
    assert written(facts) == []


@pytest.fixture(scope="module")
def two_phase_server() -> Iterator[PostgresServer]:
    """A private server that allows prepared transactions (max_prepared_transactions is 0, so
    two-phase commit is off, by default)."""
    with private_embedded("fence-2pc") as server:
        rows(server.admin_dsn, "ALTER SYSTEM SET max_prepared_transactions = 4")
        server.restart()
        yield server


@pytest.fixture
def two_phase_dsn(two_phase_server: PostgresServer) -> Iterator[str]:
    with temporary_database(two_phase_server, "fence_2pc") as dsn:
        rows(dsn, "CREATE TABLE public.facts (writer text NOT NULL)")
        yield dsn


def prepare_inside(ctx: RunContext) -> None:
    with ctx.transaction() as cur:
        insert(cur, "prepared")
        cur.execute("PREPARE TRANSACTION 'fenced'")


def prepare_around(ctx: RunContext) -> None:
    with ctx.connection.transaction():
        with ctx.transaction() as cur:
            insert(cur, "prepared")
        ctx.connection.execute("PREPARE TRANSACTION 'around'")


@pytest.mark.parametrize("work", [prepare_inside, prepare_around])
def test_a_fenced_transaction_cannot_be_prepared(
    two_phase_dsn: str, work: Callable[[RunContext], None], lock_mode: str
) -> None:
    """PREPARE TRANSACTION of a fenced transaction (inside run.transaction(), or of the work's
    own transaction around one) is refused: COMMIT PREPARED would run no check, and could land
    after the lock is lost. Nothing is prepared or written, and the key is not blocked."""
    with pytest.raises(TransactionMisuseError, match="two-phase commit"):
        run(two_phase_dsn, work)
    assert rows(two_phase_dsn, "SELECT gid FROM pg_prepared_xacts") == []
    assert written(two_phase_dsn) == []
    assert run(two_phase_dsn, writer("after")).outcome is RunOutcome.COMPLETED


def test_a_prepared_read_only_transaction_holds_a_successor_up_a_bounded_time(
    two_phase_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only fenced transaction (it writes nothing to check) that the work prepares
    makes its block fail, and the prepared transaction, which keeps the fence lock, holds the
    next attempt's takeover up only for the bound, with an error that names it and says how
    to end it."""

    def prepare_read_only(ctx: RunContext) -> None:
        with ctx.transaction(read_only=True) as cur:
            cur.execute("PREPARE TRANSACTION 'read_only'")

    with pytest.raises(TransactionMisuseError, match="ended its fenced transaction"):
        run(two_phase_dsn, prepare_read_only)
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")
    with pytest.raises(LockWaitError, match=r"a prepared transaction .*ROLLBACK PREPARED"):
        run(two_phase_dsn, writer("blocked"))
    rows(two_phase_dsn, "ROLLBACK PREPARED 'read_only'")
    assert run(two_phase_dsn, writer("after")).outcome is RunOutcome.COMPLETED
    assert written(two_phase_dsn) == ["after"]
