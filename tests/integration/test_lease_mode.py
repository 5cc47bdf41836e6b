"""The lease lock mode (issue 32, docs/locks.md) on a real PostgreSQL: the lease itself (taken
only when free or expired, a new fencing token on every takeover, renewed, released), the mode
chosen in one place, a killed worker's key free again within the lease's time to live, an
attempt whose lease expired that can no longer commit (and whose open transaction is ordered
before its successor's start), and many runs through a small PgBouncer pool in transaction
mode. The fence's own tests run in both modes (the ``lock_mode`` fixture: test_fence.py,
test_fence_nesting.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from psycopg import IsolationLevel

from airflow_idempotency import leases
from airflow_idempotency.connection import connect_kwargs, lock_options
from airflow_idempotency.exceptions import ConfigurationError, LockLostError, RunLockedError
from airflow_idempotency.leases import (
    LeaseHeartbeat,
    LockMode,
    acquire_lease,
    release_lease,
    renew_lease,
)
from airflow_idempotency.locks import hold_run_lock, run_lock_key
from airflow_idempotency.runner import RunContext, RunOutcome, RunResult, run_idempotently
from airflow_idempotency.schema import ensure_schema
from devtools import pgbouncer
from devtools.postgres import PostgresServer, temporary_database
from support import ROOT
from support.db import rows
from support.locks import Background, wait_for, waiting_backends

JOB, KEY = "leased_job", "2026-10-01"
LOCK_KEY = run_lock_key(JOB, KEY)


@pytest.fixture
def lease_db(pg_server: PostgresServer) -> Iterator[str]:
    """A fresh database of this file's own (prefix lease_) with the bookkeeping schema and a
    table ``public.facts`` the work writes to."""
    with temporary_database(pg_server, "lease_test") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ensure_schema(conn)
            conn.execute("CREATE TABLE public.facts (writer text NOT NULL, k text)")
        yield dsn


def connect_to(dsn: str) -> Callable[[], psycopg.Connection[Any]]:
    return lambda: psycopg.connect(dsn)


def writer(name: str) -> Callable[[RunContext], dict[str, str]]:
    def work(ctx: RunContext) -> dict[str, str]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES (%s, %s)", (name, ctx.run_key))
        return {"writer": name}

    return work


def run_in(dsn: str, work: Any, lock_mode: str | LockMode) -> RunResult:
    """One run of the test's job and key on ``dsn`` in ``lock_mode``."""
    return run_idempotently(
        connect=connect_to(dsn), job_name=JOB, run_key=KEY, work=work, lock_mode=lock_mode
    )


def written(dsn: str) -> list[str]:
    return [w for (w,) in rows(dsn, "SELECT writer FROM public.facts ORDER BY writer")]


def outcomes(dsn: str) -> list[str]:
    found = rows(dsn, "SELECT outcome FROM idempotency.job_run_attempts ORDER BY attempt_id")
    return [o for (o,) in found]


def test_a_lease_is_taken_only_when_free_or_expired_with_a_new_token_each_time(
    lease_db: str,
) -> None:
    """Taken when free; refused while live; renewed while live; renewed once expired while
    nobody took it over (migration 18); taken over after it expired with a larger token, and
    never renewed again then; released only by its own token."""
    expire = "UPDATE idempotency.run_leases SET expires_at = clock_timestamp()"
    with psycopg.connect(lease_db, autocommit=True) as conn:
        first = acquire_lease(conn, LOCK_KEY, schema="idempotency", ttl=30)
        assert first is not None and first.is_lease and first.backend_pid == 0
        assert acquire_lease(conn, LOCK_KEY, schema="idempotency", ttl=30) is None
        assert renew_lease(conn, first, schema="idempotency", ttl=30)
        rows(lease_db, expire)
        assert renew_lease(conn, first, schema="idempotency", ttl=30)  # still its token
        assert acquire_lease(conn, LOCK_KEY, schema="idempotency", ttl=30) is None
        rows(lease_db, expire)
        second = acquire_lease(conn, LOCK_KEY, schema="idempotency", ttl=30)
        assert not renew_lease(conn, first, schema="idempotency", ttl=30)  # taken over
        assert second is not None
        assert leases.lease_token(second) > leases.lease_token(first)
        assert not release_lease(conn, first, schema="idempotency")  # not the holder now
        held = "SELECT idempotency.run_lock_held_by(%s, 0, %s)"
        assert rows(lease_db, held, (LOCK_KEY, second.holder)) == [(True,)]
        assert rows(lease_db, held, (LOCK_KEY, first.holder)) == [(False,)]
        assert release_lease(conn, second, schema="idempotency")
        assert rows(lease_db, held, (LOCK_KEY, second.holder)) == [(False,)]
        third = acquire_lease(conn, LOCK_KEY, schema="idempotency", ttl=30)
        assert third is not None and leases.lease_token(third) > leases.lease_token(second)


def test_a_release_is_one_statement_whose_lock_wait_is_bounded(
    lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release (sql: lease_release) runs as one statement in autocommit, no transaction
    block (a pooler in statement mode lets it through), and its lock waits are still bounded:
    behind a session holding the lease's row it gives up after the bound (1 s here), with the
    session's own lock_timeout untouched; then it releases."""
    monkeypatch.setenv("AIRFLOW_IDEMPOTENCY_LOCK_WAIT", "1")
    with psycopg.connect(lease_db, autocommit=True) as conn:
        lease = acquire_lease(conn, LOCK_KEY, schema="idempotency", ttl=30)
        assert lease is not None
        with psycopg.connect(lease_db) as holder:
            holder.execute("SELECT 1 FROM idempotency.run_leases FOR UPDATE")
            began = time.monotonic()
            with pytest.raises(psycopg.errors.LockNotAvailable):
                release_lease(conn, lease, schema="idempotency")
            assert 0.9 < time.monotonic() - began < 10
        assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
        assert release_lease(conn, lease, schema="idempotency")
    assert rows(lease_db, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]


def test_the_two_modes_exclude_each_other(lease_db: str) -> None:
    """A run of the advisory mode holding the key refuses a lease; a live lease refuses a run
    of the advisory mode at its start (nothing of it is written)."""
    with (
        psycopg.connect(lease_db, autocommit=True) as holder,
        hold_run_lock(holder, LOCK_KEY, schema="idempotency", application_name="t") as lock,
    ):
        assert lock is not None
        with pytest.raises(RunLockedError, match="backend pid"):
            run_in(lease_db, writer("x"), "lease")
    with psycopg.connect(lease_db, autocommit=True) as conn:
        lease = acquire_lease(conn, LOCK_KEY, schema="idempotency", ttl=30)
    assert lease is not None
    with pytest.raises(LockLostError, match="held by a lease"):
        run_idempotently(
            connect=connect_to(lease_db), job_name=JOB, run_key=KEY, work=writer("advisory")
        )
    with pytest.raises(RunLockedError, match=r"lease token \d+ of worker"):
        run_in(lease_db, writer("lease"), "lease")
    assert written(lease_db) == []


def test_the_clis_reset_is_refused_while_a_lease_is_live(
    lease_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`reset` holds the key's advisory lock, which a lease does not: it is refused (exit 75)
    while a lease is live too, and resets the key once the lease is gone."""
    from airflow_idempotency.cli import main

    def fail(ctx: RunContext) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        run_in(lease_db, fail, "lease")
    with psycopg.connect(lease_db, autocommit=True) as conn:
        lease = acquire_lease(conn, LOCK_KEY, schema="idempotency", ttl=30)
        assert lease is not None
        argv = ["reset", JOB, KEY, "--reason", "stuck", "--dsn", lease_db]
        assert main(argv) == 75
        assert "is locked" in capsys.readouterr().err
        release_lease(conn, lease, schema="idempotency")
    assert main(argv) == 0


def test_the_lock_mode_is_checked_and_read_from_the_connections_extra() -> None:
    """A bad lock_mode or lease_ttl names the allowed values and runs nothing; the Airflow
    connection's extra chooses them, and they never reach libpq."""
    with pytest.raises(ConfigurationError, match="one of advisory, lease"):
        run_idempotently(
            connect=lambda: pytest.fail("connected"),
            job_name=JOB,
            run_key=KEY,
            work=writer("x"),
            lock_mode="leases",
        )
    with pytest.raises(ConfigurationError, match="at least 1 and at most 3600"):
        run_idempotently(
            connect=lambda: pytest.fail("connected"),
            job_name=JOB,
            run_key=KEY,
            work=writer("x"),
            lock_mode=LockMode("lease", lease_ttl=0),
        )
    conn = SimpleNamespace(
        conn_id="jobs",
        host="db",
        login="u",
        password=None,
        schema="jobs",
        port=5432,
        extra_dejson={"lock_mode": "lease", "lease_ttl": 20, "sslmode": "prefer"},
    )
    assert lock_options(conn) == {"lock_mode": LockMode("lease", 20.0)}
    kwargs = connect_kwargs(conn)
    assert kwargs["sslmode"] == "prefer" and "lock_mode" not in kwargs and "lease_ttl" not in kwargs
    conn.extra_dejson = {}
    assert lock_options(conn) == {"lock_mode": LockMode("advisory", 30.0)}
    conn.extra_dejson = {"lock_mode": "Lease-ish"}
    with pytest.raises(ConfigurationError, match="Airflow connection 'jobs': lock_mode"):
        lock_options(conn)


def test_a_run_holds_no_connection_between_its_statements(lease_db: str) -> None:
    """While the work of a lease-mode run sleeps, the run has no transaction open anywhere (the
    work's own connection is idle), the heartbeat renews the lease, and the completion
    releases it; the attempt names its lease, not a lock session."""
    seen: dict[str, Any] = {}

    def work(ctx: RunContext) -> None:
        before = rows(lease_db, "SELECT expires_at FROM idempotency.run_leases")[0][0]
        time.sleep(1.6)  # the heartbeat renews every ttl / 3 = 1 s
        seen["renewed"] = rows(lease_db, "SELECT expires_at FROM idempotency.run_leases")[0][0]
        seen["before"] = before
        seen["open"] = rows(
            lease_db,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state LIKE 'idle in transaction%%'",
        )[0][0]
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('w', %s)", (ctx.run_key,))

    result = run_in(lease_db, work, LockMode("lease", lease_ttl=3))
    assert result.outcome is RunOutcome.COMPLETED
    assert seen["open"] == 0
    assert seen["renewed"] > seen["before"]
    assert rows(lease_db, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]
    assert rows(lease_db, "SELECT count(*) FROM idempotency.fence_arms") == [(0,)]
    ((pid, lease),) = rows(
        lease_db, "SELECT lock_backend_pid, details->>'lease' FROM idempotency.job_run_attempts"
    )
    assert pid is None and lease.startswith("lease:")
    again = run_in(lease_db, work, "lease")
    assert again.outcome is RunOutcome.NOOP
    assert written(lease_db) == ["w"]


WORKER = textwrap.dedent(
    """
    import sys, time, psycopg
    from airflow_idempotency import run_idempotently
    from airflow_idempotency.leases import LockMode

    def work(run):
        print("working", flush=True)
        time.sleep(120)

    run_idempotently(connect=lambda: psycopg.connect(sys.argv[1]), job_name=sys.argv[2],
                     run_key=sys.argv[3], work=work, lock_mode=LockMode("lease", 3))
    """
)


def test_a_killed_workers_key_is_free_again_within_the_ttl(lease_db: str) -> None:
    """A worker process SIGKILLed mid-run (its sessions close, but nothing held its key): the
    key is refused until the lease expires, free within its time to live (3 s) of the
    worker's last renewal, and the next run takes it over (the dead attempt closed as
    abandoned) and completes."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'provider'}{os.pathsep}{ROOT}"}
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, lease_db, JOB, KEY],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "working"
        os.kill(worker.pid, signal.SIGKILL)
        killed = time.monotonic()
        worker.wait(10)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
    with pytest.raises(RunLockedError, match="lease token"):
        run_in(lease_db, writer("x"), "lease")
    taken_over: RunOutcome | None = None
    while taken_over is None:
        assert time.monotonic() - killed < 3 + 1.5, "the key was not free within the ttl"
        try:
            taken_over = run_in(lease_db, writer("next"), "lease").outcome
        except RunLockedError:
            time.sleep(0.1)
    assert taken_over is RunOutcome.COMPLETED
    assert written(lease_db) == ["next"]
    assert [o for o in outcomes(lease_db) if o != "lock_held"] == ["lock_lost", "completed"]


@pytest.fixture
def frozen_heartbeats(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """The lock keys whose heartbeats stop renewing (as a worker paused, or cut off): their
    leases expire after their time to live while the run goes on."""
    frozen: set[int] = set()
    renew = LeaseHeartbeat._renew

    def maybe_renew(self: LeaseHeartbeat) -> bool:
        return True if self.lock.lock_key in frozen else renew(self)

    monkeypatch.setattr(LeaseHeartbeat, "_renew", maybe_renew)
    return frozen


def test_an_attempt_whose_lease_expired_cannot_commit_and_is_ordered_before_its_successor(
    lease_db: str, frozen_heartbeats: set[int]
) -> None:
    """An attempt whose heartbeat stopped keeps a transaction open past its lease's expiry; a
    successor takes the key over and its start waits for that transaction; the old COMMIT is
    refused (IF001: LockLostError), the successor starts after it ended and completes; only
    its write lands. A later transaction of the old attempt is refused at its BEGIN."""
    frozen_heartbeats.add(LOCK_KEY)
    opened, go = threading.Event(), threading.Event()

    def old_work(ctx: RunContext) -> None:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('old', %s)", (ctx.run_key,))
            opened.set()
            assert go.wait(30)

    old = Background(lambda: run_in(lease_db, old_work, LockMode("lease", lease_ttl=1)))
    assert opened.wait(15)
    time.sleep(1.2)  # the lease expired: nobody renewed it
    frozen_heartbeats.clear()  # the successor's heartbeat renews
    new = Background(lambda: run_in(lease_db, writer("new"), "lease"))
    wait_for("the successor's start to wait", lambda: bool(waiting_backends(lease_db, 2)))
    time.sleep(0.3)
    assert outcomes(lease_db) == ["running"]
    released_at = rows(lease_db, "SELECT clock_timestamp()")[0][0]
    go.set()
    assert isinstance(old.join().error, LockLostError), old.error
    assert "was lost before this transaction" in str(old.error)
    assert new.join().error is None and new.result.outcome is RunOutcome.COMPLETED
    ((started,),) = rows(
        lease_db,
        "SELECT started_at FROM idempotency.job_run_attempts WHERE outcome = 'completed'",
    )
    assert started > released_at
    assert written(lease_db) == ["new"]
    assert outcomes(lease_db) == ["lock_lost", "completed"]


def test_a_lost_lease_found_by_the_heartbeat_fails_the_next_fenced_step(lease_db: str) -> None:
    """The heartbeat finds the lease taken over (no row renewed): the run's next fenced
    transaction raises LockLostError before it begins, the attempt ends lock_lost."""
    seen: list[bool] = []

    def work(ctx: RunContext) -> None:
        rows(lease_db, "UPDATE idempotency.run_leases SET token = token + 1000")  # stolen
        wait_for("the heartbeat to see it", ctx.lock_session_ended, timeout=5)
        seen.append(ctx.lock_is_held())
        with ctx.transaction() as cur:  # pragma: no cover - refused before it begins
            cur.execute("INSERT INTO public.facts VALUES ('late', %s)", (ctx.run_key,))

    with pytest.raises(LockLostError, match="expired or was taken over"):
        run_in(lease_db, work, LockMode("lease", lease_ttl=3))
    assert seen == [False]
    assert written(lease_db) == []
    assert outcomes(lease_db) == ["lock_lost"]


def test_a_renewal_that_timed_out_in_the_poolers_queue_is_retried_within_the_ttl(
    lease_db: str,
) -> None:
    """The heartbeat's first renewal waits 4.5 s for a connection and fails (as PgBouncer's
    query_wait_timeout ends a client's wait): it is retried a second later, not a whole
    interval (ttl / 3 = 3 s) later, which would be after the 9 s lease expired. The run, whose
    work lasts past the first expiry, completes; the long wait is logged."""
    failed: list[float] = []

    def connect() -> psycopg.Connection[Any]:
        if threading.current_thread().name.startswith("lease-heartbeat") and not failed:
            time.sleep(4.5)
            failed.append(time.monotonic())
            raise psycopg.OperationalError("query_wait_timeout")
        return psycopg.connect(lease_db)

    def work(ctx: RunContext) -> dict[str, str]:
        time.sleep(10.5)  # past 9 s: only a retried renewal keeps the lease
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('slow', %s)", (ctx.run_key,))
        return {"writer": "slow"}

    result = run_idempotently(
        connect=connect, job_name=JOB, run_key=KEY, work=work,
        lock_mode=LockMode("lease", lease_ttl=9),
    )  # fmt: skip
    assert failed, "the heartbeat's renewal never ran"
    assert result.outcome is RunOutcome.COMPLETED
    assert written(lease_db) == ["slow"]


RUNS, POOL = 20, 5


def test_twenty_runs_at_once_through_a_transaction_pooler_of_five(
    pg_server: PostgresServer, lease_db: str
) -> None:
    """PgBouncer in transaction mode, default_pool_size 5, 20 runs at once (each sleeps 1 s
    and writes one row through run.transaction()): in the lease mode every run completes and
    each key's row is written once (the advisory mode needs a pool of 21 for this)."""
    if not pgbouncer.installed():
        pytest.skip("pgbouncer is not installed: apt-get install pgbouncer")
    dbname = psycopg.conninfo.conninfo_to_dict(lease_db)["dbname"]
    settings = {"query_wait_timeout": "30"}
    with pgbouncer.run_pgbouncer(pg_server, "transaction", POOL, settings) as bouncer:
        dsn = bouncer.dsn(str(dbname))

        def work(ctx: RunContext) -> None:
            time.sleep(1)
            with ctx.transaction() as cur:
                cur.execute("INSERT INTO public.facts VALUES ('w', %s)", (ctx.run_key,))

        def one(i: int) -> Any:
            return run_idempotently(
                connect=connect_to(dsn),
                job_name=JOB,
                run_key=f"key-{i:02d}",
                work=work,
                lock_mode="lease",
            )

        began = time.monotonic()
        runs = [Background(lambda i=i: one(i)) for i in range(RUNS)]  # type: ignore[misc]
        for run in runs:
            run.join(120)
        elapsed = time.monotonic() - began
        errors = [repr(run.error) for run in runs if run.error is not None]
        assert errors == [], errors
        assert {run.result.outcome for run in runs} == {RunOutcome.COMPLETED}
        servers = rows(
            lease_db,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name <> 'psql'",
        )
    per_key = rows(lease_db, "SELECT k, count(*) FROM public.facts GROUP BY k ORDER BY k")
    assert per_key == [(f"key-{i:02d}", 1) for i in range(RUNS)]
    assert servers[0][0] <= POOL + 1  # the pool's connections, and this query's own
    print(f"{RUNS} runs through a pool of {POOL}: {elapsed:.1f} s")


def test_a_noop_takes_no_lease_and_holds_the_key_for_its_decision(lease_db: str) -> None:
    """Migration 0019: the no-op of a completed key is decided and recorded in one transaction
    that holds the key's advisory run lock and draws no lease (no token, no run_leases row).
    While that transaction runs (here: held at its no-op's INSERT by a table lock), the key is
    held as under a lease: a lease is refused to anyone else, and so is another lease-mode run;
    a live lease of another worker (a forced run about to start) refuses the no-op itself, as
    does a run of the advisory mode holding the key."""
    assert run_in(lease_db, writer("first"), "lease").outcome is RunOutcome.COMPLETED
    tokens = "SELECT last_value FROM idempotency.run_lease_tokens"
    (before,) = rows(lease_db, tokens)
    assert run_in(lease_db, writer("again"), "lease").outcome is RunOutcome.NOOP
    assert rows(lease_db, tokens) == [before]  # no token drawn
    assert rows(lease_db, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]

    with psycopg.connect(lease_db) as blocker:
        blocker.execute("LOCK TABLE idempotency.job_run_attempts IN SHARE MODE")
        noop = Background(lambda: run_in(lease_db, writer("noop"), "lease"))
        wait_for("the no-op to wait at its record", lambda: bool(waiting_on_attempts(lease_db)))
        with psycopg.connect(lease_db, autocommit=True) as conn:
            assert acquire_lease(conn, LOCK_KEY, schema="idempotency", ttl=30) is None
        blocker.rollback()
    assert noop.join().error is None and noop.result.outcome is RunOutcome.NOOP

    with psycopg.connect(lease_db, autocommit=True) as conn:
        lease = acquire_lease(conn, LOCK_KEY, schema="idempotency", ttl=30)
        assert lease is not None
        with pytest.raises(RunLockedError, match=r"lease token \d+ of worker"):
            run_in(lease_db, writer("x"), "lease")
        release_lease(conn, lease, schema="idempotency")
    with (
        psycopg.connect(lease_db, autocommit=True) as holder,
        hold_run_lock(holder, LOCK_KEY, schema="idempotency", application_name="t") as lock,
    ):
        assert lock is not None
        with pytest.raises(RunLockedError, match="backend pid"):
            run_in(lease_db, writer("x"), "lease")
    assert written(lease_db) == ["first"]
    assert outcomes(lease_db) == ["completed", "noop", "noop", "lock_held", "lock_held"]


def waiting_on_attempts(dsn: str) -> list[Any]:
    """The backends waiting for a lock on job_run_attempts."""
    return rows(
        dsn,
        "SELECT l.pid FROM pg_locks AS l JOIN pg_class AS c ON c.oid = l.relation "
        "WHERE c.relname = 'job_run_attempts' AND NOT l.granted",
    )


def test_the_completion_releases_the_lease_at_its_commit_only_when_it_commits(
    lease_db: str, frozen_heartbeats: set[int]
) -> None:
    """Migration 0019: the completion releases its lease in its own transaction, after the
    fence's check at COMMIT; a completion refused at COMMIT (its key taken over while a
    deferred trigger of the work's ran in it) releases nothing and commits nothing."""
    result = run_in(lease_db, writer("w"), "lease")
    assert result.outcome is RunOutcome.COMPLETED
    assert rows(lease_db, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]
    assert rows(lease_db, "SELECT count(*) FROM idempotency.lease_releases") == [(0,)]
    assert rows(lease_db, "SELECT count(*) FROM idempotency.fence_arms") == [(0,)]

    frozen_heartbeats.add(run_lock_key(JOB, "2026-10-02"))

    def expire_then_finish(ctx: RunContext) -> None:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('late', %s)", (ctx.run_key,))
        # a deferred trigger of the completion's transaction during which another run takes
        # the key over (a new token): the fence's check at COMMIT (queued before the release)
        # must refuse it
        rows(
            lease_db,
            "CREATE FUNCTION public.slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "PERFORM pg_sleep(1.5); RETURN NULL; END $$",
        )
        rows(
            lease_db,
            "CREATE CONSTRAINT TRIGGER slow AFTER UPDATE ON idempotency.job_runs "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.slow()",
        )
        take_over = (
            "UPDATE idempotency.run_leases SET token = nextval('idempotency.run_lease_tokens')"
            " WHERE lock_key = %s"
        )
        key = run_lock_key(JOB, "2026-10-02")

        def take_over_later() -> None:  # while the completion's COMMIT runs its slow trigger
            time.sleep(0.7)
            rows(lease_db, take_over, (key,))

        threading.Thread(target=take_over_later).start()

    with pytest.raises(LockLostError, match="was lost before this transaction"):
        run_idempotently(
            connect=connect_to(lease_db), job_name=JOB, run_key="2026-10-02",
            work=expire_then_finish, lock_mode=LockMode("lease", lease_ttl=1),
        )  # fmt: skip
    assert rows(
        lease_db, "SELECT status FROM idempotency.job_runs WHERE run_key = '2026-10-02'"
    ) == [("failed",)]
    assert outcomes(lease_db)[-1] == "lock_lost"
    assert rows(lease_db, "SELECT count(*) FROM idempotency.lease_releases") == [(0,)]


# A lease is held until another run takes its key over, not until it expires (migration 18):
# a run whose heartbeat was late goes on when nobody took its key; whatever takes an expired
# key over leaves its old holder unable to commit again.

SHORT = LockMode("lease", lease_ttl=1)


def expired(dsn: str) -> bool:
    found = rows(
        dsn,
        "SELECT expires_at <= clock_timestamp() FROM idempotency.run_leases WHERE lock_key = %s",
        (LOCK_KEY,),
    )
    return bool(found and found[0][0])


def wait_until_expired(dsn: str) -> None:
    deadline = time.monotonic() + 10
    while not expired(dsn):
        assert time.monotonic() < deadline, "the lease did not expire within 10 s"
        time.sleep(0.1)


def test_a_run_whose_lease_expired_unclaimed_goes_on_and_completes(
    lease_db: str, frozen_heartbeats: set[int]
) -> None:
    """The heartbeat is late (frozen) past the lease's expiry and nobody wants the key: the
    run's next transactions and its completion commit (before migration 18: LockLostError),
    and a heartbeat that comes back renews the expired lease."""
    frozen_heartbeats.add(LOCK_KEY)

    def work(ctx: RunContext) -> dict[str, str]:
        wait_until_expired(lease_db)
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('late', %s)", (ctx.run_key,))
        frozen_heartbeats.clear()
        assert ctx.lock_is_held()
        return {}

    result = run_in(lease_db, work, SHORT)
    assert result.outcome is RunOutcome.COMPLETED
    assert written(lease_db) == ["late"]
    assert outcomes(lease_db) == ["completed"]
    assert rows(lease_db, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]  # released


def test_a_repeatable_read_transaction_still_needs_an_unexpired_lease(
    lease_db: str, frozen_heartbeats: set[int]
) -> None:
    """A REPEATABLE READ transaction reads the lease through its snapshot (which may predate a
    take-over): begun before the expiry, its COMMIT after it is refused, nothing of it lands;
    READ COMMITTED in the same run commits."""
    frozen_heartbeats.add(LOCK_KEY)

    def work(ctx: RunContext) -> None:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('committed', %s)", (ctx.run_key,))
        with ctx.transaction(isolation_level=IsolationLevel.REPEATABLE_READ) as cur:
            cur.execute("INSERT INTO public.facts VALUES ('repeatable', %s)", (ctx.run_key,))
            wait_until_expired(lease_db)

    with pytest.raises(LockLostError):
        run_in(lease_db, work, SHORT)
    assert written(lease_db) == ["committed"]


def expired_holder(dsn: str, name: str) -> tuple[Background, threading.Event]:
    """A lease-mode run of the key whose heartbeat is frozen (the caller adds the key to
    ``frozen_heartbeats``): its lease expires while its work waits for the returned event,
    then writes ``name`` in one more transaction. Returns once the lease has expired."""
    go = threading.Event()

    def work(ctx: RunContext) -> None:
        assert go.wait(30)  # the key's lease expires (frozen), then is taken over
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES (%s, %s)", (name, ctx.run_key))

    holder = Background(lambda: run_in(dsn, work, SHORT))
    wait_until_expired(dsn)
    return holder, go


def test_an_advisory_start_takes_an_expired_lease_over_for_good(
    lease_db: str, frozen_heartbeats: set[int]
) -> None:
    """A run of the advisory mode takes the key whose lease expired (workers disagreeing on
    lock_mode): its start removes the lease, so the old holder's next transaction is refused
    (without the removal the old token would still be found and it would commit)."""
    frozen_heartbeats.add(LOCK_KEY)
    old, go = expired_holder(lease_db, "old")
    new = run_idempotently(
        connect=connect_to(lease_db), job_name=JOB, run_key=KEY, work=writer("advisory")
    )
    assert new.outcome is RunOutcome.COMPLETED
    go.set()
    assert isinstance(old.join().error, LockLostError), old.error
    assert written(lease_db) == ["advisory"]


def test_the_clis_reset_takes_an_expired_lease_over(
    lease_db: str, frozen_heartbeats: set[int]
) -> None:
    """`reset` of a key whose lease expired (a stuck worker) resets it and removes the lease:
    the stuck worker's next transaction is refused."""
    from airflow_idempotency.cli import main

    frozen_heartbeats.add(LOCK_KEY)
    old, go = expired_holder(lease_db, "stuck")
    assert main(["reset", JOB, KEY, "--reason", "stuck", "--dsn", lease_db]) == 0
    assert rows(lease_db, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]
    go.set()
    assert isinstance(old.join().error, LockLostError), old.error
    assert written(lease_db) == []
