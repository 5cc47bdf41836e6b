"""A failover of the job database under a lease-mode run (issue 32, goal 3): every backend
ends at once and connections are refused for a few seconds (a dedicated PostgreSQL stopped
with ``pg_ctl stop -m immediate``, as a writer failover ends every session, then started
again). The lease, a row, survives; the heartbeat rides the outage (its renewals fail, are
retried every second, and succeed once the server is back, within the lease's time to live);
the run's work connection died with its backends, so its next transaction ends the run
``lock_lost`` cleanly; nothing commits twice, and a rerun converges."""

from __future__ import annotations

import logging
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from airflow_idempotency.exceptions import LockLostError
from airflow_idempotency.leases import LockMode
from airflow_idempotency.runner import RunContext, RunOutcome, run_idempotently
from airflow_idempotency.schema import ensure_schema
from devtools.pgbouncer import installed as pgbouncer_installed
from devtools.pgbouncer import run_pgbouncer
from devtools.postgres import PostgresServer, _as_nobody, dedicated_cluster, system_binaries
from support.db import rows
from support.locks import Background, lose_first_completion, wait_for

OUTAGE_SECONDS = 6.0
TTL = 15.0  # > the outage: the heartbeat's renewals resume before the lease expires


@pytest.fixture
def cluster() -> Iterator[PostgresServer]:
    if system_binaries() is None:
        pytest.skip(
            "no PostgreSQL binaries to run a dedicated cluster (apt-get install postgresql)"
        )
    with dedicated_cluster("failover", {"max_connections": "50"}) as server:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            ensure_schema(conn)
            conn.execute("CREATE TABLE public.steps (attempt bigint, step text)")
        yield server


def stop_at_once(server: PostgresServer) -> Callable[[], None]:
    """End every backend at once (an immediate stop: no goodbye to any client; connections
    are refused from now on); returns what starts the server again with its own options."""
    with psycopg.connect(server.admin_dsn) as conn:
        (data,) = conn.execute("SHOW data_directory").fetchone() or ("",)
    opts = shlex.split((Path(data) / "postmaster.opts").read_text())[1:]  # after the binary
    pg_ctl = [*_as_nobody(), str(system_binaries() / "pg_ctl"), "-D", data, "-w", "-t", "60"]  # type: ignore[operator]
    subprocess.run([*pg_ctl, "-m", "immediate", "stop"], check=True, capture_output=True)
    options = shlex.join(o for o in opts if o not in ("-D", data))

    def start() -> None:
        subprocess.run(
            [*pg_ctl, "-l", str(Path(data).parent / "server.log"), "-o", options, "start"],
            check=True, capture_output=True, timeout=90,
        )  # fmt: skip

    return start


def fail_over(server: PostgresServer, seconds: float) -> None:
    """End every backend at once, refuse connections for ``seconds``, then start again."""
    start = stop_at_once(server)
    time.sleep(seconds)
    start()


def test_a_failover_ends_a_lease_run_lock_lost_cleanly_and_a_rerun_converges(
    cluster: PostgresServer,
) -> None:
    dsn = cluster.admin_dsn
    committed, back = threading.Event(), threading.Event()

    def work(ctx: RunContext) -> dict[str, int]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.steps VALUES (%s, 'first')", (ctx.attempt_id,))
        committed.set()
        assert back.wait(60)
        time.sleep(1.5)  # a heartbeat renewal after the restart
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.steps VALUES (%s, 'second')", (ctx.attempt_id,))
        return {"steps": 2}

    def run() -> object:
        return run_idempotently(
            connect=lambda: psycopg.connect(dsn), job_name="failover", run_key="2026-10-01",
            work=work, lock_mode=LockMode("lease", lease_ttl=TTL),
        )  # fmt: skip

    first = Background(run)
    assert committed.wait(30)
    fail_over(cluster, OUTAGE_SECONDS)
    ((restarted,),) = rows(dsn, "SELECT clock_timestamp()")
    (live,) = rows(dsn, "SELECT count(*) FROM idempotency.run_leases WHERE expires_at > now()")[0]
    assert live == 1, "the lease expired during the outage"
    wait_for(
        "the heartbeat to renew the lease after the restart",
        lambda: rows(dsn, "SELECT renewed_at FROM idempotency.run_leases")[0][0] > restarted,
        timeout=TTL / 3 + 3,
    )
    back.set()
    assert isinstance(first.join().error, LockLostError), first.error
    committed.clear()
    back.set()
    result = run()
    assert result.outcome is RunOutcome.COMPLETED  # type: ignore[attr-defined]
    attempts = rows(
        dsn, "SELECT attempt_id, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id"
    )
    assert [outcome for _, outcome in attempts] == ["lock_lost", "completed"]
    (old, _), (new, _) = attempts
    steps = rows(
        dsn, "SELECT attempt, step, count(*) FROM public.steps GROUP BY 1, 2 ORDER BY 1, 2"
    )
    assert steps == [(old, "first", 1), (new, "first", 1), (new, "second", 1)]
    assert rows(dsn, "SELECT count(*) FROM idempotency.run_leases")[0] == (0,)


def test_a_failover_while_the_completion_connects_is_waited_out_and_the_run_completes(
    cluster: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The work committed, then the database fails over before the completion's connection is
    opened (every backend ended, connections refused for 3 s, then the server's own start): the
    completion waits for the database to answer again, within the lock wait, says so, and
    completes. The work committed once, one attempt, completed (the completion used to fail,
    and the rerun did the work again)."""
    dsn = cluster.admin_dsn
    restarts: list[threading.Timer] = []

    def work(ctx: RunContext) -> dict[str, int]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.steps VALUES (%s, 'only')", (ctx.attempt_id,))
        restarts.append(threading.Timer(3.0, stop_at_once(cluster)))
        restarts[0].start()
        return {"steps": 1}

    caplog.set_level(logging.WARNING)
    try:
        result = run_idempotently(
            connect=lambda: psycopg.connect(dsn), job_name="failover", run_key="2026-10-02",
            work=work, lock_mode=LockMode("lease", lease_ttl=TTL),
        )  # fmt: skip
    finally:
        for timer in restarts:
            timer.join()
    assert restarts, "the work did not run"
    assert result.outcome is RunOutcome.COMPLETED
    attempts = rows(dsn, "SELECT attempt_id, outcome FROM idempotency.job_run_attempts")
    assert [outcome for _, outcome in attempts] == ["completed"]
    assert rows(dsn, "SELECT step, count(*) FROM public.steps GROUP BY 1") == [("only", 1)]
    said = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert said and "it to answer again" in said[0], said


@pytest.mark.skipif(not pgbouncer_installed(), reason="pgbouncer is not installed")
def test_a_failover_behind_pgbouncer_while_the_completion_connects_is_waited_out(
    cluster: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The same failover with PgBouncer in front (transaction mode, query_wait_timeout 4 s, the server down 8 s,
    at most half the lease's ttl as docs/deploying.md asks): PgBouncer takes the completion's
    connection (it answers for the server), then refuses its transaction, before sending any
    of it to a server: 'server login has been failing, try again later
    (server_login_retry)' or query_wait_timeout. Nothing of the completion reached a server,
    so it is tried again within the lock wait; the run completes, its work once (the
    completion used to fail, lock_lost, and the rerun did the work again)."""
    restarts: list[threading.Thread] = []
    settings = {"query_wait_timeout": "4", "server_login_retry": "2"}
    with run_pgbouncer(cluster, "transaction", pool_size=4, settings=settings) as bouncer:
        dsn = bouncer.dsn("postgres")

        def work(ctx: RunContext) -> dict[str, int]:
            with ctx.transaction() as cur:
                cur.execute("INSERT INTO public.steps VALUES (%s, 'only')", (ctx.attempt_id,))
            restarts.append(threading.Thread(target=fail_over, args=(cluster, 8.0)))
            restarts[0].start()
            time.sleep(1.0)  # the server is down as the completion connects
            return {"steps": 1}

        caplog.set_level(logging.WARNING)
        try:
            result = run_idempotently(
                connect=lambda: psycopg.connect(dsn), job_name="failover",
                run_key="2026-10-03", work=work, lock_mode=LockMode("lease", lease_ttl=TTL),
            )  # fmt: skip
        finally:
            for thread in restarts:
                thread.join()
    assert restarts, "the work did not run"
    assert result.outcome is RunOutcome.COMPLETED
    direct = cluster.admin_dsn
    attempts = rows(direct, "SELECT attempt_id, outcome FROM idempotency.job_run_attempts")
    assert [outcome for _, outcome in attempts] == ["completed"]
    assert rows(direct, "SELECT step, count(*) FROM public.steps GROUP BY 1") == [("only", 1)]
    said = [r.getMessage() for r in caplog.records]
    assert any("trying it again" in m or "waiting up to" in m for m in said), said


def test_a_completion_whose_reply_is_lost_after_its_commit_is_completed_once(
    cluster: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion's COMMIT lands, then its connection is lost before the reply (a failover
    at that instant): the try again is refused by the fence (the lease went with that COMMIT),
    and the attempt's recorded outcome tells the run it completed: COMPLETED, once, no failure
    written over it."""
    dsn = cluster.admin_dsn
    tries = lose_first_completion(monkeypatch)

    def work(ctx: RunContext) -> dict[str, int]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.steps VALUES (%s, 'only')", (ctx.attempt_id,))
        return {"steps": 1}

    result = run_idempotently(
        connect=lambda: psycopg.connect(dsn), job_name="failover", run_key="2026-10-04",
        work=work, lock_mode=LockMode("lease", lease_ttl=TTL),
    )  # fmt: skip
    assert result.outcome is RunOutcome.COMPLETED
    assert tries[0] is True, tries
    attempts = rows(dsn, "SELECT outcome, error FROM idempotency.job_run_attempts")
    assert attempts == [("completed", None)], attempts
    assert rows(dsn, "SELECT status FROM idempotency.job_runs") == [("completed",)]
    assert rows(dsn, "SELECT count(*) FROM idempotency.run_leases")[0] == (0,)
