"""The idempotent-run contract, independent of Airflow.

:func:`run_idempotently` executes ``work`` for one (job name, run key):

1. validate the job name and run key (nothing is written when they are refused);
2. take the advisory lock on a dedicated connection, held until the end;
   if another session holds it, record a ``lock_held`` attempt and raise
   :class:`~airflow_idempotency.exceptions.RunLockedError`;
3. read ``job_runs``: a completed key (and no ``force``) records a ``noop`` attempt and
   returns without calling ``work``;
4. record the attempt, upsert ``job_runs`` to ``started``, call ``work``;
5. after ``work`` returned, mark ``completed`` (fenced: only this attempt, only while its
   lock session is alive); on an exception mark ``failed`` and re-raise;
6. release the lock.

``dry_run`` runs ``work`` inside one transaction that is rolled back, leaves ``job_runs``
alone and records a ``dry_run`` attempt.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import socket
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import dict_row

from airflow_idempotency import records
from airflow_idempotency._sql import query
from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import IdempotencyError, LockLostError, RunLockedError
from airflow_idempotency.locks import (
    RunLock,
    close_lock_session,
    lock_is_held,
    open_lock_session,
    run_lock_key,
    split_lock_key,
)
from airflow_idempotency.records import AttemptOutcome, RunRecord, Trigger
from airflow_idempotency.run_key import check_text
from airflow_idempotency.schema import (
    DEFAULT_SCHEMA,
    ensure_schema,
    use_schema,
)

if TYPE_CHECKING:
    from airflow_idempotency.ledger import OutboundLedger

log = logging.getLogger("airflow_idempotency")

ConnectionFactory = Callable[[], AbstractContextManager[psycopg.Connection]]
"""Opens a new connection: ``lambda: psycopg.connect(dsn)``, or a pool's ``connection``."""


class RunOutcome(str, enum.Enum):
    """How a call of :func:`run_idempotently` ended (failures raise instead)."""

    COMPLETED = "completed"
    NOOP = "noop"
    DRY_RUN = "dry_run"


@dataclass(frozen=True)
class RunOptions:
    """Per-run switches. ``force`` reruns a completed key; ``dry_run`` rolls everything back."""

    force: bool = False
    dry_run: bool = False


@dataclass(frozen=True)
class RunResult:
    """What :func:`run_idempotently` did."""

    outcome: RunOutcome
    job_name: str
    run_key: str
    attempt_id: int
    counts: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly form (the operator's XCom return value)."""
        return {
            "outcome": self.outcome.value,
            "job_name": self.job_name,
            "run_key": self.run_key,
            "attempt_id": self.attempt_id,
            "counts": self.counts,
        }


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
        text = msg % args if args else msg
        prefix = f"job={self._job_name} run_key={self._run_key} attempt={self.attempt or '-'}"
        self._logger.log(level, "%s %s", prefix, text)

    def info(self, msg: str, *args: Any) -> None:
        self._emit(logging.INFO, msg, args)

    def warning(self, msg: str, *args: Any) -> None:
        self._emit(logging.WARNING, msg, args)

    def error(self, msg: str, *args: Any) -> None:
        self._emit(logging.ERROR, msg, args)


class RunContext:
    """What ``work`` receives: the identity of the run and access to Postgres.

    :ivar job_name: the job's name (``<dag_id>.<task_id>`` by default in Airflow).
    :ivar run_key: the business period, e.g. ``2026-10-01``.
    :ivar attempt_id: this execution's row in ``job_run_attempts``.
    :ivar dry_run: writes are rolled back and external calls must not be made.
    :ivar force: the key had completed and is being recomputed on purpose.
    :ivar airflow_context: the Airflow task context, when run by an operator.
    """

    def __init__(
        self,
        *,
        job_name: str,
        run_key: str,
        attempt_id: int,
        options: RunOptions,
        trigger: Trigger,
        schema: str,
        lock: RunLock,
        connect: ConnectionFactory,
        stack: contextlib.ExitStack,
        logger: RunLogger,
        airflow_context: Any = None,
    ) -> None:
        self.job_name = job_name
        self.run_key = run_key
        self.attempt_id = attempt_id
        self.dry_run = options.dry_run
        self.force = options.force
        self.trigger = trigger
        self.schema = schema
        self.log = logger
        self.airflow_context = airflow_context
        self._lock = lock
        self._connect = connect
        self._stack = stack
        self._conn: psycopg.Connection | None = None

    @property
    def connection(self) -> psycopg.Connection:
        """The work connection (autocommit; use :meth:`transaction` to group writes)."""
        if self._conn is None:
            conn = self._stack.enter_context(self._connect())
            conn.autocommit = True
            if self.dry_run:
                # One outer transaction, rolled back at the end: every transaction() below
                # becomes a savepoint inside it, so later steps still see earlier writes.
                self._stack.enter_context(conn.transaction(force_rollback=True))
            self._conn = conn
        return self._conn

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Cursor[Any]]:
        """A transaction on the work connection, committed only if the lock is still held.

        The fencing check runs inside the transaction just before the commit, so an
        attempt that lost its lock cannot commit more writes.
        """
        conn = self.connection
        with conn.transaction(), conn.cursor() as cur:
            yield cur
            self.assert_lock_held(conn)

    def lock_is_held(self, conn: psycopg.Connection | None = None) -> bool:
        """Whether this run's lock session still holds the lock (checked from ``conn``)."""
        return lock_is_held(conn or self.connection, self._lock)

    def assert_lock_held(self, conn: psycopg.Connection | None = None) -> None:
        """Raise :class:`LockLostError` if this run's lock session has ended."""
        if not self.lock_is_held(conn):
            raise LockLostError(
                f"the lock of job {self.job_name!r} run_key {self.run_key!r} is no longer held by "
                f"this attempt (its session, backend pid {self._lock.backend_pid}, ended): "
                "stopping before writing more. A rerun will pick the key up again."
            )

    def ledger(self, remote_system: str, **options: Any) -> OutboundLedger:
        """An :class:`~airflow_idempotency.ledger.OutboundLedger` for this run."""
        from airflow_idempotency.ledger import OutboundLedger

        return OutboundLedger(self, remote_system, **options)

    def bookkeeping_connection(self) -> AbstractContextManager[psycopg.Connection]:
        """A new connection with search_path on the bookkeeping schema (for the ledger)."""
        return _schema_connection(self._connect, self.schema)


@contextlib.contextmanager
def _schema_connection(connect: ConnectionFactory, schema: str) -> Iterator[psycopg.Connection]:
    with connect() as conn:
        conn.autocommit = True
        use_schema(conn, schema)
        yield conn


def _describe_holder(conn: psycopg.Connection, lock_key: int) -> dict[str, Any]:
    hi, lo = split_lock_key(lock_key)
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            query("run_lock_holder"), {"lock_key": lock_key, "lock_hi": hi, "lock_lo": lo}
        ).fetchone()
    if not row:
        return {}
    holder = {k: v for k, v in row.items() if not k.startswith("attempt_")}
    if row["attempt_attempt_id"] is not None:
        holder["attempt"] = {
            k.removeprefix("attempt_"): v for k, v in row.items() if k.startswith("attempt_")
        }
    return holder


def _application_name() -> str:
    """What pg_stat_activity shows for a run's lock session (Postgres keeps 63 bytes)."""
    return f"airflow-idempotency {socket.gethostname()} pid {os.getpid()}"


def _format_holder(holder: Mapping[str, Any]) -> str:
    if not holder:
        return "a session that released it a moment ago"
    parts = [f"backend pid {holder.get('pid')}"]
    if holder.get("application_name"):
        parts.append(f"application {holder['application_name']!r}")
    client = holder.get("client_hostname") or holder.get("client_addr") or "local socket"
    parts.append(f"client {client}")
    if holder.get("backend_start"):
        parts.append(f"connected since {holder['backend_start'].isoformat()}")
    attempt = holder.get("attempt")
    if attempt:
        parts.append(
            f"worker {attempt['hostname']} pid {attempt['pid']} (attempt {attempt['attempt_id']}, "
            f"dag {attempt['dag_id']} run {attempt['run_id']}, "
            f"started {attempt['started_at'].isoformat()})"
        )
    return ", ".join(parts)


def _jsonable_counts(value: Mapping[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"the work function must return a dict of counts or None, got {type(value).__name__}"
        )
    counts = dict(value)
    json.dumps(counts)  # fails loudly here rather than half-way through the completion write
    return counts


_DEFAULT_OPTIONS = RunOptions()
_UNKNOWN_TRIGGER = Trigger()


def run_idempotently(
    *,
    connect: ConnectionFactory,
    job_name: str,
    run_key: str,
    work: Callable[[RunContext], Mapping[str, Any] | None],
    options: RunOptions = _DEFAULT_OPTIONS,
    trigger: Trigger = _UNKNOWN_TRIGGER,
    schema: str = DEFAULT_SCHEMA,
    airflow_context: Any = None,
    logger: logging.Logger | None = None,
) -> RunResult:
    """Execute ``work`` at most once to completion for (job_name, run_key). See the module doc."""
    check_text(job_name, "job name")
    check_text(run_key, "run key")
    lock_key = run_lock_key(job_name, run_key)
    run_log = RunLogger(logger or log, job_name, run_key)
    with contextlib.ExitStack() as stack:
        lock_conn = stack.enter_context(connect())
        lock_conn.autocommit = True
        ensure_schema(lock_conn, schema)
        lock, previous = open_lock_session(
            lock_conn, lock_key, schema=schema, application_name=_application_name()
        )
        # Releases the lock and hands the session back with the settings it came with
        # (a pooled connection must not keep search_path on the bookkeeping schema).
        stack.callback(close_lock_session, lock_conn, lock_key, lock, previous)
        if lock is None:
            holder = _describe_holder(lock_conn, lock_key)
            attempt_id = records.insert_attempt(
                lock_conn,
                job_name=job_name,
                run_key=run_key,
                lock_key=lock_key,
                outcome="lock_held",
                trigger=trigger,
                lock=None,
                force=options.force,
                dry_run=options.dry_run,
                details={"holder": json.loads(json.dumps(holder, default=str))},
            )
            message = (
                f"job {job_name!r} run_key {run_key!r} is locked by another execution: "
                f"{_format_holder(holder)}"
            )
            run_log.attempt = attempt_id
            run_log.warning("%s", message)
            raise RunLockedError(message, holder=holder)
        crash_point("runner.after_lock")
        return _run_locked(
            lock_conn=lock_conn,
            lock=lock,
            connect=connect,
            job_name=job_name,
            run_key=run_key,
            work=work,
            options=options,
            trigger=trigger,
            schema=schema,
            airflow_context=airflow_context,
            run_log=run_log,
        )
    raise AssertionError("unreachable")  # pragma: no cover


def _run_locked(
    *,
    lock_conn: psycopg.Connection,
    lock: RunLock,
    connect: ConnectionFactory,
    job_name: str,
    run_key: str,
    work: Callable[[RunContext], Mapping[str, Any] | None],
    options: RunOptions,
    trigger: Trigger,
    schema: str,
    airflow_context: Any,
    run_log: RunLogger,
) -> RunResult:
    ids: dict[str, Any] = {"job_name": job_name, "run_key": run_key, "lock_key": lock.lock_key}
    existing: RunRecord | None = records.get_run(lock_conn, job_name, run_key)
    if existing is not None and existing.status == "completed" and not options.force:
        attempt_id = records.insert_attempt(
            lock_conn,
            **ids,
            outcome="noop",
            trigger=trigger,
            lock=lock,
            dry_run=options.dry_run,
            details={
                "completed_at": existing.completed_at.isoformat() if existing.completed_at else None
            },
        )
        run_log.attempt = attempt_id
        run_log.info(
            "found existing completed run (completed %s by %s, %s attempt(s)): no-op. "
            "Set force=true in the run's conf to recompute it.",
            existing.completed_at,
            existing.triggered_by,
            existing.attempt_count,
        )
        return RunResult(RunOutcome.NOOP, job_name, run_key, attempt_id, dict(existing.details))

    if options.dry_run:
        attempt_id = records.insert_attempt(
            lock_conn,
            **ids,
            outcome="running",
            trigger=trigger,
            lock=lock,
            force=options.force,
            dry_run=True,
        )
        run_log.attempt = attempt_id
        run_log.info("dry run: work runs in a transaction that is rolled back; job_runs untouched")
    else:
        attempt_id, count = records.start_attempt(
            lock_conn, **ids, trigger=trigger, lock=lock, force=options.force
        )
        run_log.attempt = attempt_id
        previous = existing.status if existing else "new"
        run_log.info("started (previous status: %s, attempt #%d of this key)", previous, count)
        crash_point("runner.after_started")

    try:
        with (
            contextlib.ExitStack() as work_stack
        ):  # closes the work connection, rolls back a dry run
            ctx = RunContext(
                job_name=job_name,
                run_key=run_key,
                attempt_id=attempt_id,
                options=options,
                trigger=trigger,
                schema=schema,
                lock=lock,
                connect=connect,
                stack=work_stack,
                logger=run_log,
                airflow_context=airflow_context,
            )
            counts = _jsonable_counts(work(ctx))
    except BaseException as exc:
        _record_failure(lock_conn, connect, schema, ids, attempt_id, exc, options, run_log)
        raise

    if options.dry_run:
        records.finish_attempt(lock_conn, attempt_id, "dry_run", details={"counts": counts})
        run_log.info("dry run finished, rolled back: %s", counts)
        return RunResult(RunOutcome.DRY_RUN, job_name, run_key, attempt_id, counts)

    crash_point("runner.before_completion")
    try:
        done = records.complete_attempt(
            lock_conn,
            job_name=job_name,
            run_key=run_key,
            attempt_id=attempt_id,
            lock=lock,
            counts=counts,
        )
        if not done:
            raise LockLostError(
                f"job {job_name!r} run_key {run_key!r}: attempt {attempt_id} finished its work "
                "but no longer owns the run or its lock, so it may not mark it completed. "
                "Another attempt took over or the lock session ended; rerun to converge."
            )
    except (psycopg.OperationalError, LockLostError) as exc:
        lost = (
            exc
            if isinstance(exc, LockLostError)
            else LockLostError(
                f"job {job_name!r} run_key {run_key!r}: the lock connection was lost before the "
                f"completion could be recorded ({exc}); it is not marked completed and a rerun "
                "converges."
            )
        )
        _record_failure(lock_conn, connect, schema, ids, attempt_id, lost, options, run_log)
        raise lost from exc
    run_log.info("completed: %s", counts)
    return RunResult(RunOutcome.COMPLETED, job_name, run_key, attempt_id, counts)


def _record_failure(
    lock_conn: psycopg.Connection,
    connect: ConnectionFactory,
    schema: str,
    ids: Mapping[str, Any],
    attempt_id: int,
    exc: BaseException,
    options: RunOptions,
    run_log: RunLogger,
) -> None:
    """Mark the attempt (and, unless dry run, the run) failed; never mask ``exc``."""
    outcome: AttemptOutcome = "lock_lost" if isinstance(exc, LockLostError) else "failed"
    error = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:4000]
    run_log.error("%s: %s", outcome, error)

    def write(conn: psycopg.Connection) -> None:
        with conn.transaction():
            records.finish_attempt(conn, attempt_id, outcome, error=error)
            if not options.dry_run:
                records.mark_failed(
                    conn,
                    job_name=ids["job_name"],
                    run_key=ids["run_key"],
                    attempt_id=attempt_id,
                    error=error,
                )

    if not (lock_conn.closed or lock_conn.broken):
        try:
            write(lock_conn)
            return
        except psycopg.OperationalError:
            pass  # terminated server-side: psycopg only learns it from a failed statement
    # The lock session is gone; record the failure from a fresh session. mark_failed only
    # touches the run if this attempt still owns it, so a successor is never overwritten.
    try:
        with _schema_connection(connect, schema) as conn:
            write(conn)
    except (psycopg.Error, IdempotencyError) as record_exc:
        run_log.warning(
            "could not record the failure (%s); job_runs may still say started", record_exc
        )
