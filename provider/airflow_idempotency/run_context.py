"""What the work of one run receives: :class:`RunContext`, and its logger :class:`RunLogger`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import psycopg

from airflow_idempotency.exceptions import LockLostError
from airflow_idempotency.locks import RunLock, lock_is_held
from airflow_idempotency.metrics import NO_METRICS, Metrics
from airflow_idempotency.records import Trigger

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
    :ivar trigger: who or what started the run, and its Airflow ids.
    :ivar schema: the bookkeeping schema (``idempotency`` by default).
    :ivar log: logs lines prefixed with the job, run key and attempt.
    :ivar airflow_context: the Airflow task context, when run by an operator.
    :ivar metrics: where the run's metrics go (the ledger counts its effects there).
    """

    def __init__(
        self,
        *,
        job_name: str,
        run_key: str,
        attempt_id: int,
        dry_run: bool,
        force: bool,
        trigger: Trigger,
        schema: str,
        lock: RunLock,
        connection: psycopg.Connection,
        connect: ConnectionFactory,
        logger: RunLogger,
        airflow_context: Any = None,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self.job_name = job_name
        self.run_key = run_key
        self.attempt_id = attempt_id
        self.dry_run = dry_run
        self.force = force
        self.trigger = trigger
        self.schema = schema
        self.log = logger
        self.airflow_context = airflow_context
        self.metrics = metrics
        self._lock = lock
        self._conn = connection
        self._connect = connect

    @property
    def connection(self) -> psycopg.Connection:
        """The work connection (autocommit; use :meth:`transaction` to group writes).

        In a dry run it is inside one transaction that is rolled back at the end: every
        :meth:`transaction` becomes a savepoint in it, so later steps see earlier writes.
        """
        return self._conn

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Cursor[Any]]:
        """A transaction on the work connection, committed only if the lock is still held.

        The fencing check runs inside the transaction just before the commit, so an
        attempt that lost its lock cannot commit more writes.
        """
        conn = self._conn
        try:
            with conn.transaction(), conn.cursor() as cur:
                yield cur
                self.assert_lock_held(conn)
        except psycopg.OperationalError as exc:
            if not (conn.closed or conn.broken):
                raise  # e.g. a deadlock or a cancelled statement: the session is fine
            raise LockLostError(
                f"job {self.job_name!r} run_key {self.run_key!r} lost its connection to the job "
                f"database ({str(exc).strip()}): this transaction did not commit, and this "
                "attempt cannot know whether it still holds its lock. A rerun converges."
            ) from exc

    def lock_is_held(self, conn: psycopg.Connection | None = None) -> bool:
        """Whether this run's lock session still holds the lock (checked from ``conn``)."""
        return lock_is_held(conn or self._conn, self.schema, self._lock)

    def assert_lock_held(self, conn: psycopg.Connection | None = None) -> None:
        """Raise :class:`LockLostError` if this run's lock session has ended."""
        if not self.lock_is_held(conn):
            raise LockLostError(
                f"the lock of job {self.job_name!r} run_key {self.run_key!r} is no longer held by "
                f"this attempt (its session, backend pid {self._lock.backend_pid}, ended): "
                "stopping before writing more. A rerun will pick the key up again."
            )

    def bookkeeping_connection(self) -> AbstractContextManager[psycopg.Connection]:
        """A new autocommit connection to the job database (the ledger writes through one)."""
        return autocommit_connection(self._connect)


@contextlib.contextmanager
def autocommit_connection(connect: ConnectionFactory) -> Iterator[psycopg.Connection]:
    """A new connection from ``connect`` in autocommit mode, for the provider's own statements.

    Server-side prepared statements are off: behind a pooler in transaction mode the next
    statement may run on another server connection, where a statement psycopg prepared
    would be missing, or be another client's of the same name.
    """
    with connect() as conn:
        conn.autocommit = True
        conn.prepare_threshold = None
        yield conn
