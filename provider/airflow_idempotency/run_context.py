"""What the work of one run receives (``RunContext``, ``RunLogger``) and ``RunEnvironment``.

The work gets a :class:`RunContext` and its logger :class:`RunLogger`; its caller says where
runs keep their records and report with a :class:`RunEnvironment`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import IsolationLevel
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_random_exponential,
)

from airflow_idempotency._sql import query
from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import LockLostError
from airflow_idempotency.fence import Fence, lock_wait_refusal
from airflow_idempotency.locks import (
    LOCK_WAIT_ENV,
    RunLock,
    lock_is_held,
    lock_wait_ms,
    no_slot,
    session_ended,
    unreachable_for_now,
)
from airflow_idempotency.metrics import NO_METRICS, Metrics, run_timing
from airflow_idempotency.records import RunIdentity, RunOptions
from airflow_idempotency.schema import DEFAULT_SCHEMA

ConnectionFactory = Callable[[], AbstractContextManager[psycopg.Connection]]
"""Opens a new connection: ``lambda: psycopg.connect(dsn)``, or a pool's ``connection``."""


class RunLogger:
    """Logs ``job=... run_key=... attempt=... message`` lines through ``logger``.

    The prefix travels as a format argument, never inside the format string, so a job name
    or run key containing ``%`` is logged verbatim. Works with stdlib loggers and with
    Airflow's structlog task logger alike.
    """

    def __init__(self, logger: Any, job_name: str, run_key: str) -> None:
        self._logger = logger
        self._job_name = job_name
        self._run_key = run_key
        self.attempt: int | None = None

    def _emit(self, level: int, msg: str, args: tuple[Any, ...]) -> None:
        enabled = getattr(self._logger, "isEnabledFor", None)
        if enabled is not None and not enabled(level):
            return  # a stdlib logger that drops the line: nothing to format
        text = msg % args if args else msg
        prefix = f"job={self._job_name} run_key={self._run_key} attempt={self.attempt or '-'}"
        self._logger.log(level, "%s %s", prefix, text)

    def info(self, msg: str, *args: Any) -> None:
        self._emit(logging.INFO, msg, args)

    def warning(self, msg: str, *args: Any) -> None:
        self._emit(logging.WARNING, msg, args)

    def error(self, msg: str, *args: Any) -> None:
        self._emit(logging.ERROR, msg, args)


@dataclass(frozen=True)
class RunEnvironment:
    """Where a run keeps its records and where it reports, the same for every run of a
    caller: the operator passes its own; a script's runs usually keep the defaults.

    :ivar schema: the Postgres schema of the bookkeeping tables (``idempotency``).
    :ivar logger: a stdlib logger, or Airflow's structlog task logger; ``None``: the
        ``airflow_idempotency`` logger.
    :ivar metrics: receives the counters and timers of :mod:`airflow_idempotency.metrics`
        (the operator passes Airflow's); none by default.
    :ivar airflow_context: the Airflow task context, when an operator runs it
        (:attr:`RunContext.airflow_context`).
    """

    schema: str = DEFAULT_SCHEMA
    logger: Any = None
    metrics: Metrics = NO_METRICS
    airflow_context: Any = None


@dataclass(frozen=True)
class RunSpec:
    """Everything about a run that is known before it starts: which run it is and its
    switches, where its records live (``connect``, and the environment's ``schema``), and
    where it reports (the rest of its environment)."""

    run: RunIdentity
    options: RunOptions
    connect: ConnectionFactory
    environment: RunEnvironment
    # how the run holds its key: "advisory" (a lock transaction for the whole run) or "lease"
    # (airflow_idempotency.leases), and the lease's time to live in seconds
    lock_mode: str = "advisory"
    lease_ttl: float = 30.0


class RunContext:
    """What ``work`` receives: the identity of the run and access to Postgres.

    :ivar job_name: the job's name (``<dag_id>.<task_id>`` by default in Airflow).
    :ivar run_key: the business period, e.g. ``2026-10-01``.
    :ivar attempt_id: this execution's row in ``job_run_attempts``.
    :ivar dry_run: writes are rolled back and external calls must not be made.
    :ivar force: the key had completed and is being recomputed on purpose.
    :ivar trigger: who or what started the run, and its Airflow ids.
    :ivar schema: the bookkeeping schema (``idempotency`` by default).
    :ivar log: logs lines prefixed with the job, run key and attempt.
    :ivar airflow_context: the Airflow task context, when run by an operator.
    :ivar metrics: where the run's metrics go (the ledger counts its effects there).
    """

    def __init__(
        self,
        spec: RunSpec,
        *,
        attempt_id: int,
        lock: RunLock,
        connection: psycopg.Connection,
        log: RunLogger,
        lock_connection: psycopg.Connection | None = None,
    ) -> None:
        self.job_name = spec.run.job_name
        self.run_key = spec.run.run_key
        self.attempt_id = attempt_id
        self.dry_run = spec.options.dry_run
        self.force = spec.options.force
        self.trigger = spec.run.trigger
        self.schema = spec.environment.schema
        self.log = log
        self.airflow_context = spec.environment.airflow_context
        self.metrics = spec.environment.metrics
        self._lock = lock
        self._lock_conn = lock_connection
        self._fence = Fence(lock, attempt_id, self.schema, self.job_name, self.run_key)
        self._conn = connection
        self._connect = spec.connect
        # the exception that last left a transaction() block (rolling it back): a deferral
        # raised inside one lost the block's writes (airflow_task.deferrable refuses it)
        self._rolled_back_by: BaseException | None = None

    @property
    def connection(self) -> psycopg.Connection:
        """The work connection (autocommit; use :meth:`transaction` to group writes).

        In a dry run it is inside one transaction that is rolled back at the end: every
        :meth:`transaction` becomes a savepoint in it, so later steps see earlier writes.
        """
        return self._conn

    @contextlib.contextmanager
    def transaction(
        self, *, isolation_level: IsolationLevel | None = None, read_only: bool = False
    ) -> Iterator[psycopg.Cursor[Any]]:
        """A fenced transaction on the work connection (see :meth:`fenced_transaction`).

        ``isolation_level`` (``psycopg.IsolationLevel``) defaults to the database's default;
        REPEATABLE READ and SERIALIZABLE work is safe, and a serialization failure (or a
        deadlock) raises :class:`~airflow_idempotency.exceptions.WorkConflictError`, which a
        retry resolves. ``read_only`` begins it READ ONLY. In a dry run the whole work is one
        transaction, so these two have no effect there; inside a transaction of the work's own
        on :attr:`connection` it is a savepoint, fenced at that transaction's COMMIT. The
        block must not end the transaction itself (no COMMIT, ROLLBACK or PREPARE
        TRANSACTION: :class:`~airflow_idempotency.exceptions.TransactionMisuseError`).
        """
        conn = self._conn
        fenced = self._fence.transaction(
            conn, isolation_level=isolation_level, read_only=read_only, bound_locks=False
        )
        try:
            with fenced, conn.cursor() as cur:
                yield cur
                crash_point("transaction.before_commit")
        except psycopg.Error as exc:
            raise self._fence.translate_error(exc, conn) from exc
        except BaseException as exc:
            self._rolled_back_by = exc
            raise

    def fenced_transaction(
        self,
        conn: psycopg.Connection,
        *,
        isolation_level: IsolationLevel | None = None,
        read_only: bool = False,
    ) -> AbstractContextManager[None]:
        """A transaction on ``conn`` (a connection of this run) that is fenced: it commits
        only while this attempt holds the run lock, and a successor waits for it
        (:meth:`airflow_idempotency.fence.Fence.transaction`; docs/fence.md). Every lock wait
        in it is bounded (``AIRFLOW_IDEMPOTENCY_LOCK_WAIT``): the provider's own writes (the
        ledger's) run in it.

        Raises psycopg errors; :meth:`translate_error` names them (the fence's refusal is
        SQLSTATE ``IF001``). Inside an open transaction (a dry run's) it is a savepoint.
        """
        return self._fence.transaction(
            conn, isolation_level=isolation_level, read_only=read_only, bound_locks=True
        )

    def translate_error(self, exc: psycopg.Error, conn: psycopg.Connection) -> BaseException:
        """The error to raise for ``exc``, raised by a fenced transaction on ``conn`` of the
        provider's own (:meth:`fenced_transaction`: its lock waits are bounded)."""
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            what = f"a transaction of job {self.job_name!r} run_key {self.run_key!r}"
            waited = lock_wait_refusal(exc, what)
            if waited is not None:
                return waited
        return self._fence.translate_error(exc, conn)

    def lock_is_held(self, conn: psycopg.Connection | None = None) -> bool:
        """Whether this run's lock session still holds the lock (checked from ``conn``)."""
        return lock_is_held(conn or self._conn, self.schema, self._lock)

    def lock_session_ended(self) -> bool:
        """Whether the lock session has visibly ended, without a round trip
        (:func:`~airflow_idempotency.locks.session_ended`); ``False`` says only that no end was
        seen: :meth:`lock_is_held` asks the database."""
        if self._lock.lost is not None:  # a lease: its heartbeat says
            return self._lock.known_lost
        return self._lock_conn is not None and session_ended(self._lock_conn)

    def assert_lock_held(self, conn: psycopg.Connection | None = None) -> None:
        """Raise :class:`LockLostError` if this run's lock session has ended."""
        if not self.lock_is_held(conn):
            raise LockLostError(
                f"the lock of job {self.job_name!r} run_key {self.run_key!r} is no longer held by "
                f"this attempt ({self._lock.describe()}): "
                "stopping before writing more. A rerun will pick the key up again."
            )

    def bookkeeping_connection(self) -> AbstractContextManager[psycopg.Connection]:
        """A new autocommit connection to the job database (the ledger writes through one); one
        refused for want of a slot is asked for again, within the lock wait
        (:func:`connect_when_room`)."""

        def waited(seconds: float) -> None:
            run_timing(self.metrics, "database_wait", seconds, self.job_name)

        return autocommit_connection(
            connect_when_room(self._connect, "the outbound ledger", self.log, waited)
        )


def connect_when_room(
    connect: ConnectionFactory,
    what: str,
    log: Any,
    waited: Callable[[float], None],
    *,
    within: float | None = None,
    hopeless: Callable[[], str | None] | None = None,
) -> ConnectionFactory:
    """``connect``, tried again while the database or the pooler refuses the new connection for
    want of a slot (:func:`~airflow_idempotency.locks.no_slot`) or cannot take it for the
    moment (:func:`~airflow_idempotency.locks.unreachable_for_now`: a failover, a restart),
    pausing for at most the bound of every lock wait
    (:func:`~airflow_idempotency.locks.lock_wait_ms`) in all (each pause drawn at random below a
    cap that starts at 50 ms and doubles up to 1 s, the last one cut to what is left: then one
    last try, which a ``connect_timeout`` may lengthen). The first refusal is logged on ``log``
    with ``what`` the connection is for, and so is the last one when the bound is spent, before
    it is raised; ``waited`` is called once with the seconds waited when a try was refused
    (from the first try to the connection had or the last refusal: the refused tries too).
    For the connections a run opens after its work committed (the lease mode's completion, the
    outbound ledger's): refused, the run would fail and its rerun do the work again.
    ``within``: a shorter bound, in seconds (what is left of a caller's own). ``hopeless``:
    asked between tries, the reason the connection would be of no use any more (the lease is
    known lost: the fence would refuse what it is for), which ends the wait at once."""
    seconds = int(lock_wait_ms()) / 1000
    if within is not None:
        seconds = max(0.0, min(seconds, within))

    return functools.partial(_connection_when_room, connect, what, log, waited, seconds, hopeless)


@contextlib.contextmanager
def _connection_when_room(
    connect: ConnectionFactory,
    what: str,
    log: Any,
    waited: Callable[[float], None],
    seconds: float,
    hopeless: Callable[[], str | None] | None,
) -> Iterator[psycopg.Connection]:
    """One connection of :func:`connect_when_room` (a function of its own, not one made per
    call: decorating one costs a run's completion a few microseconds; issue 32, goal 4)."""
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        refused: BaseException | None = None
        try:  # the first try alone: the retries' machinery only once it is refused
            conn = stack.enter_context(connect())
        except BaseException as exc:
            if not _room_may_come(exc):
                raise
            refused = exc
        if refused is not None:
            wait = _RoomWait(what, log, seconds, began, hopeless)
            try:
                conn = wait.retrying(wait.again(refused, lambda: stack.enter_context(connect())))
            except BaseException as last:
                wait.gave_up(last)
                raise
            finally:  # the whole wait: a refused try may take long itself (a pool's
                # timeout, connect_timeout), not only the pauses between the tries
                waited(time.monotonic() - began)
        yield conn


def _room_may_come(exc: BaseException) -> bool:
    """Whether a refused connection may be had by waiting: a slot, or the database back."""
    return no_slot(exc) or unreachable_for_now(exc)


class _RoomWait:
    """The wait of one connection of :func:`connect_when_room`: its tries and what it says."""

    def __init__(
        self,
        what: str,
        log: Any,
        seconds: float,
        began: float,
        hopeless: Callable[[], str | None] | None = None,
    ) -> None:
        self.what, self.log, self.seconds = what, log, seconds
        self.began = began  # the first try's start: it counts against the bound
        self.said = False
        self.hopeless = hopeless
        self.why_stopped: str | None = None  # hopeless's reason, when it ended the wait
        backoff = wait_random_exponential(multiplier=0.05, min=0.02, max=1.0)
        bound = max(0.0, seconds - (time.monotonic() - began))

        def pause(state: RetryCallState) -> float:
            left = bound - (state.seconds_since_start or 0.0)
            return max(0.0, min(backoff(state), left))

        spent = stop_after_delay(bound)

        def stop(state: RetryCallState) -> bool:
            if spent(state):
                return True
            self.why_stopped = self.hopeless() if self.hopeless is not None else None
            return self.why_stopped is not None

        self.retrying = Retrying(
            stop=stop,
            wait=pause,
            retry=retry_if_exception(_room_may_come),
            before_sleep=lambda state: self._waiting(_refusal(state.outcome)),
            reraise=True,
        )

    @staticmethod
    def again(
        refused: BaseException, connect: Callable[[], psycopg.Connection]
    ) -> Callable[[], psycopg.Connection]:
        """The tries for the retries' machinery: the first is the refusal already met (so that
        it is said and paused after as any other), the others ``connect``."""
        first = [refused]

        def attempt() -> psycopg.Connection:
            if first:
                raise first.pop()
            return connect()

        return attempt

    def _waiting(self, refusal: BaseException) -> None:
        if self.said:
            return
        self.said = True
        self.log.warning(
            "the job database refused %s a connection (%s): waiting up to %g s for %s",
            self.what,
            refusal,
            self.seconds,
            "a free slot (see docs/deploying.md, pool sizing)"
            if no_slot(refusal)
            else "it to answer again",
        )

    def gave_up(self, exc: BaseException) -> None:
        """The wait ended without a connection: say why, when it did. A refusal once the bound
        was spent (a first try as long as the bound, a ``connect_timeout``, is said too); any
        other end (a task's timeout, a refusal that will not pass, ``hopeless``'s reason)
        ended the wait itself."""
        elapsed = time.monotonic() - self.began
        if self.why_stopped is not None or not _room_may_come(exc):
            if self.said:
                self.log.warning(
                    "stopped waiting for a connection for %s after %.1f s: %s",
                    self.what,
                    elapsed,
                    self.why_stopped or exc,
                )
            return
        self.log.warning(
            "the job database %s %s a connection after %.1f s%s (the bound of every lock "
            "wait, %s): giving up (%s)",
            "still refused" if self.said else "refused",
            self.what,
            elapsed,
            " of waiting" if self.said else ", its first try as long as the bound",
            LOCK_WAIT_ENV,
            exc,
        )


def _refusal(outcome: Any) -> BaseException:
    """The exception of a tenacity attempt's outcome (a refused connection)."""
    exc = outcome.exception() if outcome is not None else None
    return exc if exc is not None else RuntimeError("no outcome")


@contextlib.contextmanager
def autocommit_connection(
    connect: ConnectionFactory, *, work: bool = False
) -> Iterator[psycopg.Connection]:
    """A new connection from ``connect`` in autocommit mode, for the provider's own statements
    (``work``: the run's work connection, whose transactions get the isolation level the work
    asks for; the provider's own transactions on it begin explicitly READ COMMITTED).

    The provider's own connections are READ COMMITTED whatever the database's default (see
    :mod:`airflow_idempotency._transactions`). Server-side prepared statements are off: behind
    a pooler in transaction mode the next statement may run on another server connection,
    where a statement psycopg prepared would be missing, or be another client's of the same
    name. The connection's own settings are put back when the block ends (a pool's
    connection goes back as it came).
    """
    with connect() as conn:
        saved = (conn.autocommit, conn.prepare_threshold, conn.isolation_level)
        wanted = (True, None, saved[2] if work else IsolationLevel.READ_COMMITTED)
        _set_session(conn, saved, wanted)
        datestyle = None if work else iso_datestyle(conn)
        try:
            yield conn
        finally:
            idle = conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
            if not conn.closed and idle:
                if datestyle is not None:
                    conn.execute(query("set_datestyle", DEFAULT_SCHEMA), {"datestyle": datestyle})
                _set_session(
                    conn, (conn.autocommit, conn.prepare_threshold, conn.isolation_level), saved
                )


def iso_datestyle(conn: psycopg.Connection) -> str | None:
    """Put the idle autocommit ``conn`` in DateStyle ISO when the server's (the database's or
    role's setting) is another: psycopg reads no timestamptz then, and the provider's own
    statements read some after they committed (a completion's ``completed_at``), as the CLI
    and the UI read them. The setting it had, to put back (``None``: it was ISO, nothing
    sent)."""
    status = conn.pgconn.parameter_status(b"DateStyle")  # conn.info's, without its object
    if status is None or status.startswith(b"ISO"):
        return None
    found = status.decode("ascii", "replace")
    conn.execute(
        query("set_datestyle", DEFAULT_SCHEMA),
        {"datestyle": "ISO, " + found.split(",")[-1].strip()},
    )
    return found


def _set_session(conn: psycopg.Connection, now: tuple[Any, ...], wanted: tuple[Any, ...]) -> None:
    """Give ``conn`` the ``wanted`` (autocommit, prepare_threshold, isolation_level), setting
    only those that differ from ``now``: each of psycopg's setters takes the connection's lock
    and runs its wait loop (a pooled connection usually has them already: issue 32, goal 4).
    A connection that is not idle gets all three, so that psycopg refuses it as before."""
    every = conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE
    if every or now[0] != wanted[0]:
        conn.autocommit = wanted[0]
    if every or now[1] != wanted[1]:
        conn.prepare_threshold = wanted[1]
    if every or now[2] != wanted[2]:
        conn.isolation_level = wanted[2]
