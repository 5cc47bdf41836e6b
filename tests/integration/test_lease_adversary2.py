"""A second adversary's pass over the lease lock mode (issue 32: migrations 18 to 20, the lease
decision, the start's re-read, the lock order): each test is one attack on a database of its
own. A failing test here is a defect found (its docstring says what breaks); a passing one is an
attack that held."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_idempotency import records
from airflow_idempotency.cli import main
from airflow_idempotency.exceptions import LockLostError
from airflow_idempotency.leases import LockMode
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.runner import RunContext, RunResult, run_idempotently
from airflow_idempotency.schema import ensure_schema
from devtools.postgres import PostgresServer, temporary_database
from support.db import rows
from support.locks import Background, expire_lease, wait_for

JOB, KEY = "adv2_job", "2026-11-03"
LOCK_KEY = run_lock_key(JOB, KEY)
# renewed every 100 s: no renewal during a test; expire_lease ends it when the test says
LONG = LockMode("lease", lease_ttl=300)


@pytest.fixture
def adv_db(pg_server: PostgresServer) -> Iterator[str]:
    """A fresh database with the bookkeeping schema and ``public.facts`` the work writes to."""
    with temporary_database(pg_server, "lease_adv2") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ensure_schema(conn)
            conn.execute("CREATE TABLE public.facts (writer text NOT NULL, k text)")
        yield dsn


def run_in(dsn: str, work: Any, lock_mode: str | LockMode = LONG, **more: Any) -> RunResult:
    return run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=JOB,
        run_key=KEY,
        work=work,
        lock_mode=lock_mode,
        **more,
    )


def written(dsn: str) -> list[str]:
    return [w for (w,) in rows(dsn, "SELECT writer FROM public.facts ORDER BY writer")]


def lock_waiters(dsn: str) -> list[int]:
    """Backends of this database waiting for a row or transaction lock."""
    return [
        pid
        for (pid,) in rows(
            dsn,
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND wait_event IN ('transactionid', 'tuple')",
        )
    ]


def chain(exc: BaseException | None) -> str:
    """Every message of ``exc`` and its causes."""
    said = []
    while exc is not None:
        said.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(said)


def test_a_reset_racing_the_completion_of_an_expired_lease_never_deadlocks(
    adv_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`reset` of a key whose lease expired while its worker still runs (a late heartbeat: the
    lease is held until taken over) takes the lease over: lease_live deletes the lease row,
    THEN reset locks the run's row (reset_run). The holder's completion locks the run's row
    (complete_attempt_lease), THEN deletes its lease at its COMMIT (lease_release_on_commit).
    Opposite orders: when the completion lands between the two, each waits for the other and
    PostgreSQL's deadlock detector kills one after deadlock_timeout (a raw DeadlockDetected
    for the worker or the operator). Expected: one waits for the other, never both."""
    go = threading.Event()

    def work(ctx: RunContext) -> dict[str, int]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('holder', %s)", (ctx.run_key,))
        assert go.wait(30)
        return {}

    holder = Background(lambda: run_in(adv_db, work))
    wait_for("the holder's work", lambda: written(adv_db) == ["holder"])
    expire_lease(adv_db, JOB, KEY)  # its heartbeat late: the lease expired, nobody took it

    paused, resume = threading.Event(), threading.Event()
    get_run = records.get_run

    def get_run_paused(*args: Any, **kwargs: Any) -> Any:  # reset: after lease_live
        paused.set()
        assert resume.wait(30)
        return get_run(*args, **kwargs)

    monkeypatch.setattr(records, "get_run", get_run_paused)
    reset = Background(lambda: main(["reset", JOB, KEY, "--reason", "stuck", "--dsn", adv_db]))
    assert paused.wait(30)
    go.set()  # the holder completes now, while reset holds what it locked so far
    wait_for("the completion to wait for reset", lambda: bool(lock_waiters(adv_db)))
    resume.set()
    reset.join()
    holder.join()
    said = f"reset: {chain(reset.error)}; holder: {chain(holder.error)}"
    assert "deadlock" not in said.lower(), said
    attempts = rows(adv_db, "SELECT outcome, error FROM idempotency.job_run_attempts")
    assert not any("deadlock" in (error or "") for _, error in attempts), attempts
    # reset went first: the key is failed (reset), the holder no longer owns it
    assert reset.result == 0, said
    assert isinstance(holder.error, LockLostError), said
    assert rows(adv_db, "SELECT status FROM idempotency.job_runs") == [("failed",)]
    assert rows(adv_db, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]
