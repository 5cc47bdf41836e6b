"""The lease lock mode: a run holds its key as a lease renewed by a heartbeat (issue 32).

In the default ``advisory`` mode a run holds its key with an advisory lock, in a transaction
kept open on a connection of its own for the whole run (:func:`~airflow_idempotency.locks.
hold_run_lock`): behind a pooler in transaction mode that pins one server connection per
running task. In the ``lease`` mode (migration 14) the key is a row of ``run_leases`` with a
fencing token, taken in one short transaction when free or expired (:func:`acquire_lease`),
renewed by a heartbeat thread every ``ttl / 3`` on a connection borrowed for each renewal
(:class:`LeaseHeartbeat`), and released when the run's outcome is recorded
(:func:`release_lease`). Nothing is held between those statements.

The fence is the same protocol in both modes (docs/fence.md): only the answer to "is the lock
still held by this attempt" changes, to "the key's lease still has this attempt's token"
(``run_lock_held_by`` with the holder ``'lease:<token>'``; migration 18). Expiry only allows
another run to take the key over (a new token): a worker whose heartbeat was late, and whose
key nobody took meanwhile, goes on. The trade-off: a worker that dies frees its key when its
lease expires (within ``ttl``), not at once.
"""

from __future__ import annotations

import _thread
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import psycopg

from airflow_idempotency._sql import query, query_row
from airflow_idempotency._transactions import in_one_transaction
from airflow_idempotency.exceptions import ConfigurationError, SharedSessionError
from airflow_idempotency.locks import RunLock, lock_wait_ms, run_lock_key
from airflow_idempotency.step_watch import SlowStepWatch

log = logging.getLogger(__name__)

LOCK_MODES = ("advisory", "lease")
"""The lock modes: ``advisory`` (the default) and ``lease``."""

DEFAULT_LOCK_MODE = "advisory"

LEASE_TTL_DEFAULT = 30.0
"""Seconds a lease lasts without a renewal: a crashed worker's key is free again within it."""

_LEASE_PREFIX = "lease:"

RETRY_SECONDS = 1.0
"""After a renewal failed (the database or its pooler refused or timed out), the heartbeat
tries again this soon, not a whole interval later: the lease is lost only when no renewal
succeeded for its whole time to live."""

WAIT_NOTICE_SECONDS = 5.0
"""A lease taken or renewed after waiting this long for the job database is logged: a
pooler's queue (its pool busy) or a lock wait; docs/deploying.md, pool sizing."""


def check_lock_mode(value: Any, where: str = "lock_mode") -> str:
    """``value`` as a lock mode (``None``: the default), or a :class:`ConfigurationError`
    naming the allowed ones."""
    if value is None or value == "":
        return DEFAULT_LOCK_MODE
    mode = value.strip().lower() if isinstance(value, str) else value
    if mode not in LOCK_MODES:
        raise ConfigurationError(
            f"{where}={value!r} is not a lock mode: give one of {', '.join(LOCK_MODES)} "
            f"(default {DEFAULT_LOCK_MODE}; docs/locks.md says what each costs)"
        )
    return str(mode)


def check_lease_ttl(value: Any, where: str = "lease_ttl") -> float:
    """``value`` as a lease's time to live in seconds (``None``: :data:`LEASE_TTL_DEFAULT`),
    or a :class:`ConfigurationError`: at least 1 and at most 3600."""
    if value is None or value == "":
        return LEASE_TTL_DEFAULT
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not 1 <= seconds <= 3600:
        raise ConfigurationError(
            f"{where}={value!r}: give the lease's time to live in seconds, at least 1 and at "
            f"most 3600 (default {LEASE_TTL_DEFAULT:g}); a dead worker's key is free again "
            "within it"
        )
    return seconds


@dataclass(frozen=True)
class LockMode:
    """How a run holds its key, for ``run_idempotently(lock_mode=...)``: ``mode``
    (``"advisory"`` or ``"lease"``) and, for the lease mode, its time to live in seconds
    (``None``: :data:`LEASE_TTL_DEFAULT`). A plain string means that mode with the default
    time to live: ``lock_mode="lease"`` is ``lock_mode=LockMode("lease")``."""

    mode: str = DEFAULT_LOCK_MODE
    lease_ttl: float | None = None

    @property
    def ttl(self) -> float:
        """The lease's time to live in seconds (:data:`LEASE_TTL_DEFAULT` when not given)."""
        return LEASE_TTL_DEFAULT if self.lease_ttl is None else self.lease_ttl


def resolve_lock_mode(value: str | LockMode | None, where: str = "lock_mode") -> LockMode:
    """``value`` checked, as a :class:`LockMode` with its mode and time to live filled in
    (``None``: the default mode), or a :class:`ConfigurationError`."""
    if isinstance(value, LockMode):
        mode = check_lock_mode(value.mode, f"{where}.mode")
        return LockMode(mode, check_lease_ttl(value.lease_ttl, f"{where}.lease_ttl"))
    return LockMode(check_lock_mode(value, where), LEASE_TTL_DEFAULT)


def lease_token(lock: RunLock) -> int:
    """The fencing token of the lease ``lock``."""
    assert lock.holder is not None and lock.is_lease
    return int(lock.holder.removeprefix(_LEASE_PREFIX))


def worker_name() -> str:
    """The holder a lease records: this worker's host and pid (for the refusal message)."""
    return _worker_name_of(os.getpid())


@functools.cache
def _worker_name_of(pid: int) -> str:
    return f"{socket.gethostname()} pid {pid}"


def describe_lease(
    conn: psycopg.Connection, schema: str, lock_key: int
) -> tuple[dict[str, Any], str] | None:
    """The live lease of ``lock_key`` for a refusal (``None``: none): its row, the attempt it
    runs nested under ``attempt``, and the words naming it."""
    row = query_row(conn, "lease_holder", schema, {"lock_key": lock_key})
    if not row:
        return None
    holder = {k: v for k, v in row.items() if not k.startswith("attempt_")}
    described = (
        f"lease token {row['token']} of worker {row['holder']}, taken "
        f"{row['acquired_at'].isoformat()}, expires {row['expires_at'].isoformat()}"
        " unless renewed"
    )
    if row["attempt_attempt_id"] is not None:
        attempt = {
            k.removeprefix("attempt_"): v for k, v in row.items() if k.startswith("attempt_")
        }
        holder["attempt"] = attempt
        described += (
            f" (attempt {attempt['attempt_id']}, dag {attempt['dag_id']} run "
            f"{attempt['run_id']}, started {attempt['started_at'].isoformat()})"
        )
    return holder, described


def shared_session_error(lock_key: int) -> SharedSessionError:
    """The error for a server session that already held ``lock_key``'s advisory lock before
    this run tried its lease."""
    return SharedSessionError(
        f"the server session already held run lock {lock_key} before this run tried its "
        "lease: the connection to the job database is shared with another client that took "
        "the lock at session level (e.g. an older version of this provider behind a pooler "
        "in transaction mode). Point that client at a direct connection or pool_mode = "
        "session, or upgrade it."
    )


def acquire_lease(
    conn: psycopg.Connection, lock_key: int, *, schema: str, ttl: float
) -> RunLock | None:
    """Take the lease of ``lock_key`` for ``ttl`` seconds, in one short transaction on the
    idle autocommit ``conn``: the lease (a :class:`RunLock` whose holder is ``'lease:<token>'``
    and whose ``lost`` event the heartbeat sets), or ``None`` when another worker's lease is
    live or an advisory-mode run holds the key. Raises :class:`SharedSessionError` when the
    server session already held the key's advisory lock (as :func:`~airflow_idempotency.
    locks.hold_run_lock` does)."""
    params = {
        "lock_key": lock_key,
        "holder": worker_name(),
        "ttl": ttl,
        "lock_wait_ms": lock_wait_ms(),
    }
    _, cursor = in_one_transaction(
        conn,
        [(query("bound_lock_waits", schema), params), (query("lease_acquire", schema), params)],
    )
    row = cursor.fetchone()
    assert row is not None
    already_held, _free, token, _expires = row
    if already_held:
        raise shared_session_error(lock_key)
    if token is None:
        return None
    return RunLock(lock_key, 0, f"{_LEASE_PREFIX}{token}", lost=threading.Event())


def renew_lease(conn: psycopg.Connection, lock: RunLock, *, schema: str, ttl: float) -> bool:
    """Extend the lease ``lock`` by ``ttl`` seconds, in a short transaction, expired or not;
    ``False`` when it is lost (the key was taken over or released): it is never extended
    again."""
    params = {
        "lock_key": lock.lock_key,
        "token": lease_token(lock),
        "ttl": ttl,
        "lock_wait_ms": lock_wait_ms(),
    }
    _, cursor = in_one_transaction(
        conn, [(query("bound_lock_waits", schema), params), (query("lease_renew", schema), params)]
    )
    return cursor.fetchone() is not None


def release_lease(conn: psycopg.Connection, lock: RunLock, *, schema: str) -> bool:
    """Release the lease ``lock`` (if it is still this acquisition's) and forget its fenced
    transactions' commit-time checks; whether it was still held."""
    params = {
        "lock_key": lock.lock_key,
        "token": lease_token(lock),
        "lock_holder": lock.holder,
        "lock_wait_ms": lock_wait_ms(),
    }
    # one message, its lock waits bounded by its first statement (sql: lease_release): no
    # transaction block, so that a pooler in statement mode lets it through
    with psycopg.ClientCursor(conn) as cursor:
        cursor.execute(query("lease_release", schema), params)
        cursor.nextset()
        return cursor.fetchone() is not None


def lease_is_live(conn: psycopg.Connection, job_name: str, run_key: str, *, schema: str) -> bool:
    """Whether (``job_name``, ``run_key``) has a live lease. A caller holding the key's
    advisory run lock (the CLI's reset, an effect's resolution, adopt) treats the key as locked
    then: no lease can be taken while it holds that lock. An expired lease is taken over (its
    row deleted), the run's row locked first, until the caller's transaction ends."""
    params = {"lock_key": run_lock_key(job_name, run_key), "job_name": job_name, "run_key": run_key}
    row = conn.execute(query("lease_live", schema), params).fetchone()
    return bool(row and row[0])


Borrow = Callable[[], AbstractContextManager[psycopg.Connection]]


@functools.lru_cache(maxsize=16)
def _first_renewals(interval: float) -> SlowStepWatch:
    """The process's one watch of the leases whose first renewal is due ``interval`` seconds
    after they were taken (:meth:`LeaseHeartbeat.start`). A few intervals are kept: runs whose
    lease_ttl vary (computed per run) kept one watch per value for the life of the process
    (adv33a). A watch dropped while a lease waits on it still calls it; a heartbeat stopped
    meanwhile (its ``remove`` on the interval's new watch finds nothing) starts nothing then."""
    return SlowStepWatch(interval, name="airflow-idempotency-lease-watch")


os.register_at_fork(after_in_child=_first_renewals.cache_clear)  # the parent's watch threads


class LeaseHeartbeat:
    """Renews a lease every ``ttl / 3`` seconds from a thread of the worker, each time on a
    connection borrowed for that renewal only (``borrow``).

    The thread starts when the first renewal is due: until then one watch of the process waits
    for every lease's first renewal (:class:`~airflow_idempotency.step_watch.SlowStepWatch`),
    so a run done within ``ttl / 3`` starts no thread (a thread started and joined per run was
    about a tenth of a short run's client CPU; issue 32, goal 4). Each lease still gets its own
    thread once it renews: a renewal waiting for the database never delays another's.

    A renewal that finds the lease lost (no row updated: another run took the key over) sets
    ``lock.lost``: the run's next fenced step then raises
    :class:`~airflow_idempotency.exceptions.LockLostError` before it begins (the database
    refuses it anyway). No renewal succeeding for ``ttl`` seconds (the database or its pooler
    unreachable or busy) is said, and the renewals go on: the lease has expired, so another
    run may take the key over, but until one does this run still holds it (migration 18).
    """

    def __init__(
        self,
        lock: RunLock,
        borrow: Borrow,
        *,
        schema: str,
        ttl: float,
        logger: Any = None,
        report: Callable[[float], None] | None = None,
    ) -> None:
        assert lock.lost is not None
        self.report = report  # receives each renewal's duration in seconds (a metric)
        self.lock = lock
        self.borrow = borrow
        self.schema = schema
        self.ttl = ttl
        self.interval = ttl / 3
        self.log = logger or log
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # started when the first renewal is due
        self._renewed = time.monotonic()
        self._releasing = False
        self._guard = threading.Lock()  # the thread's start against stop()
        self._watched: object | None = None
        self._launched: threading.Event | None = None  # set once the thread's start was tried
        self._start_failures = 0

    def releasing(self) -> None:
        """The run's completion is about to release the lease at its COMMIT (migration 19): a
        renewal that finds the lease gone from now on still marks it lost, but says so only in
        the debug log (a lease lost before that COMMIT fails the completion, which says so)."""
        self._releasing = True

    def start(self) -> None:
        """Renew from now on: the first renewal is due ``ttl / 3`` from now, and the thread
        starts then (:meth:`_begin`)."""
        self._renewed = time.monotonic()
        self._watched = _first_renewals(self.interval).add(self._begin)

    def _begin(self) -> None:
        """The first renewal is due (called in the watch's thread): start the heartbeat's own
        thread, unless the run has stopped it meanwhile.

        The watch's thread does not start it itself: ``Thread.start`` waits until the new
        thread runs, a hand-over of the GIL each way, up to a switch interval each while other
        threads compute, so a thousand leases due together, started one after another, got
        their first renewal seconds late, past their expiry (adv33a). A bare thread
        (:func:`_thread.start_new_thread`, which waits for nothing) starts each one instead."""
        with self._guard:
            if self._stop.is_set():
                return
            thread = threading.Thread(
                target=self._loop, name=f"lease-heartbeat-{self.lock.lock_key}", daemon=True
            )
            self._thread, self._launched = thread, threading.Event()
            try:
                _thread.start_new_thread(self._launch, (thread, self._launched))
            except Exception as exc:  # RuntimeError: the process may start no more threads
                self._thread = None
                self._without_thread(exc)

    def _launch(self, thread: threading.Thread, launched: threading.Event) -> None:
        """Start the heartbeat's thread (in a bare thread of its own, :meth:`_begin`)."""
        try:
            thread.start()
        except RuntimeError as exc:
            with self._guard:
                self._thread = None
                if not self._stop.is_set():
                    self._without_thread(exc)
        finally:
            launched.set()

    def _without_thread(self, exc: BaseException) -> None:
        """The heartbeat's thread could not be started (a thread limit): renew now, in the
        calling thread, and try again when the next renewal is due; the lease is renewed
        meanwhile. Called with ``_guard`` held: :meth:`stop` waits for the renewal."""
        say = self.log.debug if self._start_failures else self.log.warning
        self._start_failures += 1
        say(
            "could not start the heartbeat thread of run lock %s (%s): its lease is renewed "
            "without it, and starting one tried again, every %g s",
            self.lock.lock_key,
            exc,
            self.interval,
        )
        try:
            renewed = self._renew()
        except Exception as failed:  # as in _loop: said, and tried again at the next one
            self._failed(failed)
        else:
            if not renewed:
                self._lost("another worker took the key over, or it was released")
                return
            self._renewed = time.monotonic()
        try:
            self._watched = _first_renewals(self.interval).add(self._begin)
        except RuntimeError as again:
            self._lost(f"no thread could be started to renew it ({again})")

    def stop(self) -> None:
        """Renew no more: once this returns no renewal is under way or begins (each wait for
        it bounded by ``ttl``)."""
        held = self._guard.acquire(timeout=self.ttl)  # a renewal without a thread ends first
        try:
            self._stop.set()
            watched, thread, launched = self._watched, self._thread, self._launched
        finally:
            if held:
                self._guard.release()
        if watched is not None:
            _first_renewals(self.interval).remove(watched)
        if thread is not None:
            assert launched is not None  # set with the thread (_begin)
            launched.wait(self.ttl)  # started (or not) by its bare thread
            if thread.is_alive():
                thread.join(timeout=self.ttl)

    def __enter__(self) -> LeaseHeartbeat:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _renew(self) -> bool:
        began = time.monotonic()
        try:
            with self.borrow() as conn:
                return renew_lease(conn, self.lock, schema=self.schema, ttl=self.ttl)
        finally:
            self._waited(time.monotonic() - began)

    def _waited(self, seconds: float) -> None:
        """Report one renewal's duration; say so when it waited long for the database."""
        if self.report is not None:
            self.report(seconds)
        if seconds >= min(WAIT_NOTICE_SECONDS, self.interval):
            self.log.warning(
                "renewing the lease of run lock %s took %.1f s: the job database or its "
                "pooler's queue was busy. A renewal must land within %g s of the last one "
                "(lease_ttl); keep the pooler's query_wait_timeout at most half of it (see "
                "docs/deploying.md, pool sizing)",
                self.lock.lock_key,
                seconds,
                self.ttl,
            )

    def _lost(self, why: str) -> None:
        assert self.lock.lost is not None
        self.lock.lost.set()
        say = self.log.debug if self._releasing else self.log.warning
        say(
            "the lease of run lock %s (%s) is lost: %s; the run's next fenced step fails "
            "(LockLostError)",
            self.lock.lock_key,
            self.lock.holder,
            why,
        )

    def _loop(self) -> None:
        pause = max(0.0, self.interval - (time.monotonic() - self._renewed))  # due: about 0
        while not self._stop.wait(pause):
            pause = self.interval
            try:
                renewed = self._renew()
            except Exception as exc:  # any failed renewal is retried, within the ttl
                # psycopg's errors, and whatever the run's ``connect`` raises: Airflow's
                # connection lookup, an IAM token's fetch (botocore's errors are no OSError).
                # An error escaping would end this thread: the lease would expire unnoticed.
                self._failed(exc)
                pause = min(self.interval, RETRY_SECONDS)  # try again soon, within the ttl
                continue
            if not renewed:
                self._lost("another worker took the key over, or it was released")
                return
            self._renewed = time.monotonic()

    def _failed(self, exc: BaseException) -> None:
        """A renewal failed: say so, and whether the lease has expired meanwhile."""
        silent = time.monotonic() - self._renewed
        key = self.lock.lock_key
        if silent < self.ttl:
            self.log.warning("could not renew the lease of run lock %s: %s", key, exc)
            return
        self.log.warning(
            "no renewal of the lease of run lock %s succeeded for %.0f s (last error: %s): "
            "it has expired, so another run may take the key over (this run's next fenced "
            "step is then refused); renewing goes on",
            key,
            silent,
            exc,
        )
