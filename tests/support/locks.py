"""Who holds which advisory lock, read as the provider reads it; a holder's session ended.

Ending a holder's session as a lost connection or an operator would.

Run locks are read through the provider's own reader, the SQL function ``held_run_locks()``
of the bookkeeping schema (this database's granted run locks, as the fencing checks, the
CLI's ``locks`` and the view see them); the keys through :func:`run_lock_key`. What a test
proves is left behind counts every advisory lock of the database instead: run locks, fence
keys, the migration and named locks (none may outlive a run). Who waits: for an advisory key
space (:func:`waiting_backends`), for any lock or a row's (:func:`lock_waiters`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg

from airflow_idempotency import RunContext, run_idempotently
from airflow_idempotency.locks import hold_run_lock, run_lock_key
from airflow_idempotency.records import Trigger
from devtools import invariants
from support.db import rows

# pg_terminate_backend only signals the backend unless given a timeout; with one it waits
# until the backend has exited, and so released its session locks (PostgreSQL 14+).
_WAIT_MS = 10_000


def run_lock_holders(dsn: str) -> list[tuple[int, int]]:
    """(lock key, backend pid) of every run lock held in this database; none before the
    bookkeeping schema exists."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute("SELECT to_regprocedure('idempotency.held_run_locks()')").fetchone()
        if found is None or found[0] is None:
            return []
        held = conn.execute("SELECT lock_key, pid FROM idempotency.held_run_locks() ORDER BY 2")
        return [(int(key), int(pid)) for key, pid in held.fetchall()]


def run_lock_holder(dsn: str, job: str, run_key: str) -> int | None:
    """The backend pid that holds (job, run_key)'s run lock, or None."""
    key = run_lock_key(job, run_key)
    pids = [pid for lock_key, pid in run_lock_holders(dsn) if lock_key == key]
    assert len(pids) <= 1, f"{len(pids)} holders of {job!r} {run_key!r}: {pids}"
    return pids[0] if pids else None


def advisory_locks(dsn: str, *, whole_server: bool = False) -> int:
    """Advisory locks of any family held right now in this database (pg_locks shows the
    whole cluster: other databases' are not ours), or on the whole server where the test owns
    it (a private embedded server)."""
    if whole_server:
        return int(rows(dsn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")[0][0])
    return len(invariants.rows(dsn, "advisory_locks_left"))


def lock_held_attempts(dsn: str) -> int:
    """Attempts refused because another execution held their key (outcome ``lock_held``)."""
    sql = "SELECT count(*) FROM idempotency.job_run_attempts WHERE outcome = 'lock_held'"
    return int(rows(dsn, sql)[0][0])


@contextlib.contextmanager
def key_held(
    dsn: str,
    job: str,
    run_key: str,
    trigger: Trigger | None = None,
    lock_mode: str = "advisory",
) -> Iterator[None]:
    """A run of (job, run_key) in another thread, holding the key's lock (``lock_mode``
    ``lease``: its lease) while the block runs (its work waits, at most 60 s); then the run
    completes and its thread is joined."""
    started, release = threading.Event(), threading.Event()

    def slow(ctx: RunContext) -> None:
        started.set()
        release.wait(60)

    run: dict[str, Any] = {"connect": lambda: psycopg.connect(dsn), "job_name": job}
    run.update(run_key=run_key, work=slow, lock_mode=lock_mode)
    run.update({"trigger": trigger} if trigger else {})
    worker = threading.Thread(target=run_idempotently, kwargs=run)
    worker.start()
    try:
        assert started.wait(30), f"the run of {job!r} {run_key!r} did not start its work"
        yield
    finally:
        release.set()
        worker.join(30)


@contextlib.contextmanager
def run_lock_taken(dsn: str, job: str, run_key: str) -> Iterator[None]:
    """(job, run_key)'s run lock held by a session of the test's own (application_name
    ``t``, no run and no attempt) while the block runs."""
    key = run_lock_key(job, run_key)
    with (
        psycopg.connect(dsn, autocommit=True) as holder,
        hold_run_lock(holder, key, schema="idempotency", application_name="t") as lock,
    ):
        assert lock is not None, f"the run lock of {job!r} {run_key!r} was already held"
        yield


def expire_lease(dsn: str, job: str, run_key: str) -> int:
    """End (job, run_key)'s live lease (the lease mode) as if its worker had stopped renewing
    it for its whole time to live; return its token."""
    found = rows(
        dsn,
        "UPDATE idempotency.run_leases SET expires_at = clock_timestamp()"
        " WHERE lock_key = %s AND expires_at > clock_timestamp() RETURNING token",
        (run_lock_key(job, run_key),),
    )
    assert len(found) == 1, f"expected one live lease of {job!r} {run_key!r}, found none"
    return int(found[0][0])


def take_over_lease(dsn: str, job: str, run_key: str) -> int:
    """Take (job, run_key)'s live lease over as a successor would (a new token: its holder has
    lost the key; an expired lease alone is still its holder's, migration 18), the successor
    gone at once (the lease left expired, free to take); return the old token."""
    token = expire_lease(dsn, job, run_key)
    rows(
        dsn,
        "UPDATE idempotency.run_leases SET token = nextval('idempotency.run_lease_tokens')"
        " WHERE lock_key = %s",
        (run_lock_key(job, run_key),),
    )
    return token


def lease_mode_in_use(dsn: str) -> bool:
    """Whether the bookkeeping schema has a lease table with a live lease (the lease mode)."""
    found = rows(dsn, "SELECT to_regclass('idempotency.run_leases')")
    if found[0][0] is None:
        return False
    live = "SELECT count(*) FROM idempotency.run_leases WHERE expires_at > clock_timestamp()"
    return bool(rows(dsn, live)[0][0])


def terminate_lock_session(dsn: str, job: str, run_key: str) -> int:
    """Terminate the session holding (job, run_key)'s lock and wait until it is gone; return
    its pid. Without the wait, a fencing check racing the dying backend still sees the lock.
    In the lease mode (no session holds the key), the lease is taken over instead
    (:func:`take_over_lease`; 0 is returned)."""
    pid = run_lock_holder(dsn, job, run_key)
    if pid is None and lease_mode_in_use(dsn):
        take_over_lease(dsn, job, run_key)
        return 0
    assert pid is not None, f"expected one holder of {job!r} {run_key!r}, found none"
    with psycopg.connect(dsn, autocommit=True) as conn:
        ended = conn.execute("SELECT pg_terminate_backend(%s, %s)", (pid, _WAIT_MS)).fetchone()
    assert ended == (True,), f"backend {pid} still alive after {_WAIT_MS} ms"
    return pid


def wait_for(what: str, check: Callable[[], bool], timeout: float = 15.0) -> None:
    """Poll ``check`` every 50 ms until it holds; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Background:
    """A call in a thread whose result or exception is kept for the test, with the
    ``time.monotonic()`` at which it ended (``finished_at``, None while it runs)."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished_at: float | None = None

        def body() -> None:
            try:
                self.result = call()
            except BaseException as exc:
                self.error = exc
            self.finished_at = time.monotonic()

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 30.0) -> Background:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the call did not finish"
        return self


def chain(exc: BaseException | None) -> str:
    """Every message of ``exc`` and its causes (an assertion's message)."""
    said = []
    while exc is not None:
        said.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(said)


def queue_an_alter(dsn: str, reader: psycopg.Connection[Any], table: str) -> Background:
    """An operator's ``ALTER TABLE idempotency.<table>`` queued behind a long reader (a
    pg_dump's transaction, ``reader``, which reads the table first): every new reader or writer
    of the table queues behind the ALTER until ``reader`` ends. Returns the ALTER's thread."""
    reader.execute(f"SELECT count(*) FROM idempotency.{table}")
    alter = f"ALTER TABLE idempotency.{table} ADD COLUMN adv34 int"
    altering = Background(lambda: rows(dsn, alter))
    wait_for("the ALTER to queue", lambda: bool(lock_waiters(dsn)))
    return altering


def timed_behind(
    call: Callable[[], Any], reader: psycopg.Connection[Any], altering: list[Background]
) -> tuple[Background, float]:
    """``call`` in a thread, given 10 s; then ``reader`` ends (the queued ALTERs, then the
    call's waits, go on) and all finish. The call's outcome, and how long it took."""
    began = time.monotonic()
    run = Background(call)
    try:
        run.thread.join(10)
        took = (run.finished_at or time.monotonic()) - began
    finally:
        reader.close()
        run.join()
        for alter in altering:
            alter.join()
    return run, took


def waiting_backends(dsn: str, objsubid: int) -> list[int]:
    """Backends of this database waiting for an advisory lock in the given key space."""
    found = rows(
        dsn,
        "SELECT l.pid FROM pg_locks AS l WHERE l.locktype = 'advisory' AND NOT l.granted"
        " AND l.objsubid = %s"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (objsubid,),
    )
    return [pid for (pid,) in found]


ROW_LOCKS = ("transactionid", "tuple")
"""The wait events (``pg_stat_activity.wait_event``) of a wait for a row's lock: its tuple, or
the transaction that holds it."""


def lock_waiters(dsn: str, events: Sequence[str] | None = None) -> list[int]:
    """Backends of this database waiting for a lock (``wait_event_type`` 'Lock': a row, a
    transaction, an advisory key, a relation); only those whose wait event is one of
    ``events`` when given (:data:`ROW_LOCKS`: a row's lock)."""
    sql = (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock'"
    )
    if events is None:
        return [pid for (pid,) in rows(dsn, sql)]
    return [pid for (pid,) in rows(dsn, sql + " AND wait_event = ANY(%s)", (list(events),))]


def lose_first_completion(
    monkeypatch: Any, then: Callable[[Any], None] | None = None
) -> list[bool]:
    """Make the lease mode's first completion commit, then lose its connection before the
    reply (a failover at that instant): ``then(run)`` is called before the loss is raised.
    Returns the tries' results (True: the completion was written)."""
    from airflow_idempotency import lease_run

    original = lease_run.LeaseRun._complete_and_release
    tries: list[bool] = []

    def commit_then_lose(self: Any, conn: psycopg.Connection, *args: Any) -> bool:
        done = original(self, conn, *args)
        tries.append(done)
        if len(tries) == 1:
            conn.close()
            self._released = False  # the reply never came: the run did not read it
            if then is not None:
                then(self)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return done

    monkeypatch.setattr(lease_run.LeaseRun, "_complete_and_release", commit_then_lose)
    return tries
