"""An adversary's pass over the lease lock mode, run_decide and overload handling (issue 32):
each test is one attack on a database of its own. A failing test here is a defect found (its
docstring says what breaks); a passing one is an attack that held."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from airflow_idempotency.exceptions import LockWaitError
from airflow_idempotency.leases import LeaseHeartbeat, LockMode
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.runner import RunContext, RunOutcome, RunResult, run_idempotently
from devtools.postgres import PostgresServer
from support import ROOT
from support.db import rows
from support.locks import Background, wait_for, waiting_backends

JOB, KEY = "adv_job", "2026-11-02"
LOCK_KEY = run_lock_key(JOB, KEY)


@pytest.fixture
def frozen_heartbeats(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Lock keys whose heartbeats stop renewing (a worker cut off from the database or
    paused): their leases run down while the run goes on."""
    frozen: set[int] = set()
    renew = LeaseHeartbeat._renew

    def maybe_renew(self: LeaseHeartbeat) -> bool:
        return True if self.lock.lock_key in frozen else renew(self)

    monkeypatch.setattr(LeaseHeartbeat, "_renew", maybe_renew)
    return frozen


def run_in(dsn: str, work: Any, lock_mode: str | LockMode, **more: Any) -> RunResult:
    return run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=JOB,
        run_key=KEY,
        work=work,
        lock_mode=lock_mode,
        **more,
    )


def writer(name: str) -> Callable[[RunContext], dict[str, str]]:
    def work(ctx: RunContext) -> dict[str, str]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES (%s, %s)", (name, ctx.run_key))
        return {"writer": name}

    return work


def written(dsn: str) -> list[str]:
    return [w for (w,) in rows(dsn, "SELECT writer FROM public.facts ORDER BY writer")]


def outcomes(dsn: str) -> list[str]:
    found = rows(dsn, "SELECT outcome FROM idempotency.job_run_attempts ORDER BY attempt_id")
    return [o for (o,) in found]


# A commit that becomes visible a while after its last check ran: a synchronous standby slow
# to acknowledge (RDS Multi-AZ, Patroni with synchronous_mode), a slow WAL flush. Simulated by
# a deferred trigger that fires after the fence's own commit-time check of the LAST arm of the
# first attempt's completion (constraint triggers of one event fire in name order, and the arm
# sent with the COMMIT is the last event queued), sleeping there with every lock still held.
SLOW_COMMIT = """
CREATE FUNCTION public.slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    seen integer := coalesce(nullif(current_setting('adv.arms', true), ''), '0')::integer + 1;
BEGIN
    PERFORM set_config('adv.arms', seen::text, true);
    IF seen = 2
       AND NEW.attempt_id = (SELECT min(attempt_id) FROM idempotency.job_run_attempts)
       AND EXISTS (SELECT 1 FROM idempotency.job_runs WHERE status = 'completed') THEN
        PERFORM pg_sleep((SELECT seconds FROM public.slow_commit_seconds));
    END IF;
    RETURN NULL;
END $$;
CREATE TABLE public.slow_commit_seconds (seconds float8 NOT NULL);
CREATE CONSTRAINT TRIGGER zz_slow_commit AFTER INSERT ON idempotency.fence_arms
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.slow_commit();
"""


def test_a_successor_that_read_the_run_before_a_late_completion_landed_does_not_redo_it(
    adv_db: str, frozen_heartbeats: set[int]
) -> None:
    """BREAK: the lease mode reads the run (completed or not) right after taking the lease,
    BEFORE its start's fence take-over waits for the previous attempt's open transactions. The
    previous attempt's completion passed its commit-time check just before its lease expired,
    and its COMMIT became visible a moment later (a slow synchronous standby): the successor
    took the expired lease in between, read the run as 'started', then its start waited for
    that completion, took the COMPLETED run over and did the work again. In the advisory mode
    the read comes after the old lock transaction (whose COMMIT is the completion) ended.
    Expected: the successor sees the completion and does nothing (a no-op, or a refusal that a
    rerun turns into a no-op); the key's work once. Fix (decision code, leasedecide): read the
    run again under the start's exclusive fence key (or make start_attempt refuse a run that
    became 'completed' since the read unless forced)."""
    rows(adv_db, SLOW_COMMIT)
    rows(adv_db, "INSERT INTO public.slow_commit_seconds VALUES (3.0)")
    frozen_heartbeats.add(LOCK_KEY)  # the first worker cannot renew: its lease runs down
    old = Background(lambda: run_in(adv_db, writer("old"), LockMode("lease", lease_ttl=1.5)))
    wait_for(
        "the old completion to sit in its slow COMMIT",
        lambda: bool(rows(adv_db, "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep'")),
    )
    wait_for(
        "the old lease to expire",
        lambda: rows(adv_db, "SELECT count(*) FROM idempotency.run_leases"
                     " WHERE expires_at > clock_timestamp()")[0][0] == 0,
    )  # fmt: skip
    frozen_heartbeats.clear()
    new = Background(lambda: run_in(adv_db, writer("new"), "lease"))
    old.join(30)
    new.join(30)
    assert old.error is None and old.result.outcome is RunOutcome.COMPLETED, old.error
    assert new.error is not None or new.result.outcome is RunOutcome.NOOP, (
        f"the successor ran the completed key again: {new.result}"
    )
    assert written(adv_db) == ["old"], "the key's work was done twice"


PROBE = """
SELECT current_setting('lock_timeout'), current_setting('application_name'),
       current_setting('idle_in_transaction_session_timeout'),
       current_setting('tcp_keepalives_idle'), current_setting('tcp_user_timeout'),
       coalesce(current_setting('airflow_idempotency.start_checked', true), ''),
       current_setting('transaction_isolation'), current_setting('search_path'),
       (SELECT count(*) FROM pg_prepared_statements),
       (SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'),
       (SELECT count(*) FROM pg_class WHERE relpersistence = 't')
"""


def probe_servers(dsn: str, pool: int) -> set[tuple[Any, ...]]:
    """What a plain client of the pool sees on each of its ``pool`` server connections (all
    of them taken at once, each in a transaction of its own)."""
    conns = [psycopg.connect(dsn, prepare_threshold=None) for _ in range(pool)]
    try:
        seen = set()
        for conn in conns:
            row = conn.execute(PROBE).fetchone()  # the transaction stays open: a server each
            assert row is not None
            seen.add(tuple(row))
        return seen
    finally:
        for conn in conns:
            conn.close()


def test_no_session_state_of_a_run_is_left_on_a_pooled_server_connection(
    pg_server: PostgresServer, adv_db: str
) -> None:
    """HELD: behind PgBouncer in transaction mode (pool of 2), runs of both modes and every
    decision (a new key, a no-op, a refusal while another run holds the key, a failing work, a
    start that checked its take-over) leave nothing on the pool's server connections that the
    next client gets: no setting (lock_timeout, application_name, idle timeout, keepalives,
    the start's mark), no prepared statement, advisory lock or temporary table."""
    from devtools import pgbouncer

    if not pgbouncer.installed():
        pytest.skip("pgbouncer is not installed")
    dbname = str(psycopg.conninfo.conninfo_to_dict(adv_db)["dbname"])
    with pgbouncer.run_pgbouncer(pg_server, "transaction", 2, {"query_wait_timeout": "20"}) as pb:
        dsn = pb.dsn(dbname)
        before = probe_servers(dsn, 2)
        assert len(before) == 1, before

        def one(key: str, mode: str, work: Any = None) -> Any:
            return Background(
                lambda: run_idempotently(
                    connect=lambda: psycopg.connect(dsn), job_name=JOB, run_key=key,
                    work=work or writer(mode), lock_mode=mode,
                )
            ).join(60)  # fmt: skip

        def fails(ctx: RunContext) -> None:
            with ctx.transaction() as cur:
                cur.execute("SELECT 1")
            raise RuntimeError("the work failed")

        for mode in ("lease", "advisory"):
            assert one(f"{mode}-1", mode).error is None  # a new key
            assert one(f"{mode}-1", mode).error is None  # its no-op
            assert isinstance(one(f"{mode}-2", mode, fails).error, RuntimeError)
        opened, go = threading.Event(), threading.Event()

        def holds(ctx: RunContext) -> None:
            opened.set()
            assert go.wait(30)

        holder = Background(
            lambda: run_idempotently(
                connect=lambda: psycopg.connect(dsn), job_name=JOB, run_key="held",
                work=holds, lock_mode="lease",
            )
        )  # fmt: skip
        assert opened.wait(30)
        for mode in ("lease", "advisory"):
            refused = one("held", mode)
            assert refused.error is not None, f"{mode}: a held key was run"
        go.set()
        assert holder.join(30).error is None
        after = probe_servers(dsn, 2)
    assert after == before


PAUSED_WORKER = textwrap.dedent(
    """
    import sys, psycopg
    from airflow_idempotency import run_idempotently
    from airflow_idempotency.leases import LockMode

    dsn, job, key, open_tx = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "open"

    def work(run):
        with run.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('paused-1', %s)", (run.run_key,))
        if open_tx:
            with run.transaction() as cur:
                cur.execute("INSERT INTO public.facts VALUES ('paused-2', %s)", (run.run_key,))
                print("ready", flush=True)
                sys.stdin.readline()
        else:
            print("ready", flush=True)
            sys.stdin.readline()
            with run.transaction() as cur:
                cur.execute("INSERT INTO public.facts VALUES ('paused-2', %s)", (run.run_key,))

    try:
        run_idempotently(connect=lambda: psycopg.connect(dsn), job_name=job, run_key=key,
                         work=work, lock_mode=LockMode("lease", 2))
        print("completed", flush=True)
    except Exception as exc:
        print(type(exc).__name__, flush=True)
    """
)


@pytest.mark.parametrize("open_tx", ["open", "between"])
def test_a_paused_worker_resumed_after_a_takeover_commits_nothing_more(
    adv_db: str, open_tx: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HELD (safety): a worker process SIGSTOPped (a frozen container, a VM paused) between two
    fenced transactions or inside one, for longer than its lease; a successor takes the key
    over. Resumed, the paused worker commits nothing more (its next transaction, or the open
    one, is refused: LockLostError) and does not mark the run completed.

    Liveness, inside a transaction: while the paused worker's transaction stays open the
    successor's start waits for it and gives up after the lock wait (LockWaitError, IF002):
    the key is not free again within the lease's time to live while a worker is paused
    mid-transaction (the dead-peer bound does not see a paused process: its kernel still
    answers). A rerun after the paused worker resumed converges."""
    monkeypatch.setenv("AIRFLOW_IDEMPOTENCY_LOCK_WAIT", "3")
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'provider'}{os.pathsep}{ROOT}"}
    worker = subprocess.Popen(
        [sys.executable, "-c", PAUSED_WORKER, adv_db, JOB, KEY, open_tx],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert worker.stdin is not None and worker.stdout is not None
    try:
        assert worker.stdout.readline().strip() == "ready"
        os.kill(worker.pid, signal.SIGSTOP)
        wait_for(
            "the paused worker's lease to expire",
            lambda: rows(adv_db, "SELECT count(*) FROM idempotency.run_leases"
                         " WHERE expires_at > clock_timestamp()")[0][0] == 0,
            timeout=10,
        )  # fmt: skip
        if open_tx == "open":
            with pytest.raises(LockWaitError):
                run_in(adv_db, writer("successor"), "lease")
        else:
            assert run_in(adv_db, writer("successor"), "lease").outcome is RunOutcome.COMPLETED
        os.kill(worker.pid, signal.SIGCONT)
        worker.stdin.write("go\n")
        worker.stdin.flush()
        said = worker.stdout.readline().strip()
        worker.wait(30)
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
            worker.kill()
            worker.wait(10)
    assert said == "LockLostError", said
    if open_tx == "open":
        assert run_in(adv_db, writer("successor"), "lease").outcome is RunOutcome.COMPLETED
    assert written(adv_db) == ["paused-1", "successor"]
    ((status,),) = rows(adv_db, "SELECT status FROM idempotency.job_runs")
    assert status == "completed"
    assert outcomes(adv_db)[-1] == "completed" and "completed" not in outcomes(adv_db)[:-1]


def test_a_transient_error_of_the_connect_callable_does_not_end_the_heartbeat(
    adv_db: str,
) -> None:
    """BREAK (fixed): the heartbeat retries a failed renewal only for psycopg, OSError and the
    provider's own errors. A ``connect`` callable that raises anything else once (Airflow's
    connection lookup through the API server or a secrets backend, an IAM token fetch whose
    botocore error is no OSError) ends the heartbeat's thread for good: the lease is never
    renewed again, expires after its ttl while the worker is healthy, and the run fails
    LockLostError, without the heartbeat ever marking it lost. Expected: the failed renewal
    is retried (after RETRY_SECONDS) like any other, the run completes. Fixed on branch adv32:
    LeaseHeartbeat._loop treats any Exception of a renewal as a failed renewal."""
    failed: list[str] = []

    def connect() -> psycopg.Connection[Any]:
        if threading.current_thread().name.startswith("lease-heartbeat") and not failed:
            failed.append("once")
            raise RuntimeError("the secrets backend did not answer (transient)")
        return psycopg.connect(adv_db)

    def work(ctx: RunContext) -> dict[str, str]:
        time.sleep(4.5)  # longer than the lease's ttl: only renewals keep it
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('w', %s)", (ctx.run_key,))
        return {}

    result = run_idempotently(
        connect=connect, job_name=JOB, run_key=KEY, work=work, lock_mode=LockMode("lease", 3)
    )
    assert failed == ["once"]
    assert result.outcome is RunOutcome.COMPLETED
    assert written(adv_db) == ["w"]


def test_an_advisory_start_on_a_leased_key_is_refused_at_once_and_stalls_no_lease_work(
    adv_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BREAK (mixed modes, a bounded stall): a worker whose connection extra still says
    ``advisory`` (a mode switch rolled out half-way) runs a key whose lease is live while the
    lease holder has a fenced transaction open. The advisory run takes the advisory lock (the
    lease holds none), decides 'run', and its start's fence take-over queues EXCLUSIVE behind
    the holder's open transaction: the live lease that refuses it is read only by the start
    trigger, after that wait. Meanwhile every new fenced transaction of the lease holder
    (another connection: a ledger claim inside run.transaction()) queues behind that
    exclusive request. So the advisory run is refused only after the whole lock wait
    (IF002 LockWaitError, not a refusal naming the lease), and the lease holder's transaction
    stalls for as long. Expected: refused at once (RunLockedError naming the lease), the
    holder's transactions never wait. Fix (migration): the four-argument fence_take_over
    checks fence_live_lease (for a non-lease holder) BEFORE it queues for the fence key."""
    monkeypatch.setenv("AIRFLOW_IDEMPOTENCY_LOCK_WAIT", "6")
    opened, advisory_tried, done = threading.Event(), threading.Event(), threading.Event()
    waited: list[float] = []

    def lease_work(ctx: RunContext) -> dict[str, str]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('lease-1', %s)", (ctx.run_key,))
            opened.set()
            assert advisory_tried.wait(30)
            with psycopg.connect(adv_db, autocommit=True) as other:
                began = time.monotonic()
                with ctx.fenced_transaction(other):
                    other.execute("INSERT INTO public.facts VALUES ('lease-2', %s)", (KEY,))
                waited.append(time.monotonic() - began)
        done.set()
        return {}

    holder = Background(lambda: run_in(adv_db, lease_work, "lease"))
    assert opened.wait(30)
    began = time.monotonic()
    advisory = Background(lambda: run_in(adv_db, writer("advisory"), "advisory"))
    with contextlib.suppress(AssertionError):  # refused before it queued: as expected
        wait_for("the advisory start to queue", lambda: bool(waiting_backends(adv_db, 2)), 3)
    advisory_tried.set()
    advisory.join(30)
    refused_after = (advisory.finished_at or 0) - began
    assert holder.join(30).error is None and done.is_set()
    assert written(adv_db) == ["lease-1", "lease-2"]
    assert advisory.error is not None and not isinstance(advisory.error, LockWaitError), (
        f"the advisory run waited for the lease holder's transaction: {advisory.error!r}"
    )
    assert refused_after < 3, f"refused only after {refused_after:.1f} s"
    said = str(advisory.error)
    assert "held by a lease of another worker" in said and "same lock_mode" in said, said
    assert "session ended" not in said, f"the refusal names the wrong cause: {said}"
    assert waited[0] < 2, f"the lease holder's fenced transaction waited {waited[0]:.1f} s"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"lock_mode": " LEASE\n"}, LockMode("lease", 30.0)),
        ({"lock_mode": "lease", "lease_ttl": " 45 "}, LockMode("lease", 45.0)),
        ({"lock_mode": "lease", "lease_ttl": None}, LockMode("lease", 30.0)),
        ({"lock_mode": "\uff4c\uff45\uff41\uff53\uff45"}, None),  # fullwidth
        ({"lock_mode": "lease\u200b"}, None),  # a zero-width space
        ({"lock_mode": "lea\u017fe"}, None),  # long s: casefolds to "lease", lower() does not
        ({"lock_mode": ["lease"]}, None),
        ({"lock_mode": True}, None),
        ({"lock_mode": "lease", "lease_ttl": "nan"}, None),
        ({"lock_mode": "lease", "lease_ttl": "inf"}, None),
        ({"lock_mode": "lease", "lease_ttl": 1e-400}, None),
        ({"lock_mode": "lease", "lease_ttl": 3601}, None),
        ({"lock_mode": "lease", "lease_ttl": True}, None),
        ({"lock_mode": "lease", "lease_ttl": "30s"}, None),
    ],
)
def test_spellings_of_the_lock_mode_in_the_extra(
    extra: dict[str, Any], expected: LockMode | None
) -> None:
    """HELD: the extra's lock_mode is trimmed and case-folded, anything else (fullwidth
    letters, a zero-width space, a long s, a list, a boolean) is refused by name, as is a
    lease_ttl that is NaN, infinite, underflows to 0, above an hour, a boolean or has a
    unit; a misspelled KEY is no silent default either: it reaches libpq, which refuses it."""
    from types import SimpleNamespace

    from airflow_idempotency.connection import lock_options
    from airflow_idempotency.exceptions import ConfigurationError

    conn = SimpleNamespace(conn_id="jobs", extra_dejson=extra)
    if expected is None:
        with pytest.raises(ConfigurationError, match="Airflow connection 'jobs'"):
            lock_options(conn)
    else:
        assert lock_options(conn) == {"lock_mode": expected}


def test_a_misspelled_lock_mode_key_is_refused_not_ignored(adv_db: str) -> None:
    """HELD: {"Lock_Mode": "lease"} is not this provider's option: it is passed to libpq,
    which refuses the connection (no silent fall-back to the advisory mode)."""
    from types import SimpleNamespace

    from airflow_idempotency.connection import connect_kwargs

    info = psycopg.conninfo.conninfo_to_dict(adv_db)
    conn = SimpleNamespace(
        conn_id="jobs", host=info.get("host"), login=info.get("user"), password=None,
        schema=info.get("dbname"), port=info.get("port"), extra_dejson={"Lock_Mode": "lease"},
    )  # fmt: skip
    with pytest.raises(psycopg.ProgrammingError, match="Lock_Mode"):
        psycopg.connect(**connect_kwargs(conn))
