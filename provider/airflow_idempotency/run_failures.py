"""A run's failures: the provider's error for a database failure, and how it is recorded.

:func:`named_failure` names a failure the work did not (a pooler's refusal, every session
of the attempt ended); :func:`record_failure` marks the attempt (and the run) failed without
ever masking the error, and a start that never got its attempt row is recorded by
:func:`record_refused_start`. The steps themselves are :mod:`airflow_idempotency.runner`'s.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable

import psycopg

from airflow_idempotency import metrics
from airflow_idempotency._transactions import bounded_transaction
from airflow_idempotency.exceptions import (
    ConfigurationError,
    ConnectionWaitError,
    IdempotencyError,
    LockLostError,
    LockWaitError,
    PoolExhaustedError,
)
from airflow_idempotency.fence import Fence
from airflow_idempotency.locks import RunLock, pooler_refusal, session_ended
from airflow_idempotency.records import AttemptOutcome, RunRecords
from airflow_idempotency.run_context import RunLogger, RunSpec, autocommit_connection


def named_failure(
    lock_conn: psycopg.Connection | None,
    exc: BaseException,
    spec: RunSpec,
    lock: RunLock | None = None,
) -> BaseException:
    """The provider's error for a database failure the work did not name: a connection
    refused for want of slots (:func:`pooler_refusal`: the sizing rule), or a connection
    the server ended while the lock session ended too (every session of this attempt
    terminated at once: a failover, a restart, an operator) as :class:`LockLostError`.
    Anything else is ``exc`` itself. In the lease mode (no ``lock_conn``) the lease's
    heartbeat (``lock``) says whether the lock is gone."""
    if not isinstance(exc, psycopg.Error):
        return exc
    refusal = pooler_refusal(exc)
    if refusal is not None:
        return refusal
    gone = session_ended(lock_conn) if lock_conn is not None else bool(lock and lock.known_lost)
    if isinstance(exc, psycopg.OperationalError) and gone:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return LockLostError(
            f"job {spec.run.job_name!r} run_key {spec.run.run_key!r}: the job database ended "
            f"this attempt's sessions, its lock session with them ({type(exc).__name__}: "
            f"{first}): a failover, a restart or an operator's pg_terminate_backend. Its "
            "lock is gone and its open transaction did not commit; what committed before "
            "stays. A rerun converges."
        )
    return exc


def _count(spec: RunSpec, outcome: str) -> None:
    metrics.run_outcome(spec.environment.metrics, outcome, spec.run.job_name)


def record_refused_start(
    lock_conn: psycopg.Connection | None,
    exc: BaseException,
    spec: RunSpec,
    records: RunRecords,
    log: RunLogger,
) -> None:
    """A start that a pooler refused (its pool exhausted) or whose bounded takeover ended
    is recorded as a failed attempt, in the lock transaction (which has its server
    connection), naming the cause; in the lease mode (no ``lock_conn``), on a connection
    borrowed for it."""
    refusal: BaseException | None = None
    if type(exc) in (PoolExhaustedError, ConnectionWaitError, ConfigurationError) or isinstance(
        exc, LockWaitError
    ):
        refusal = exc
    elif isinstance(exc, psycopg.Error):
        refusal = pooler_refusal(exc)
    if refusal is None or (lock_conn is not None and (lock_conn.closed or lock_conn.broken)):
        return
    log.error("%s", refusal)
    _count(spec, "failed")
    if lock_conn is None:
        with (
            contextlib.suppress(psycopg.Error, IdempotencyError),
            autocommit_connection(spec.connect) as conn,
        ):
            log.attempt = records.insert_attempt(
                conn, "failed", lock=None, options=spec.options, error=str(refusal)
            )
        return
    with contextlib.suppress(psycopg.Error):
        log.attempt = records.insert_attempt(
            lock_conn,
            "failed",
            lock=None,
            options=spec.options,
            error=str(refusal),
            and_commit=True,
        )


def record_failure(
    lock_conn: psycopg.Connection | None,
    exc: BaseException,
    spec: RunSpec,
    records: RunRecords,
    log: RunLogger,
    attempt_id: int | None,
    fence: Fence | None = None,
) -> None:
    """Mark the attempt (and, unless dry run, the run) failed; never mask ``exc``.

    Written in the lock transaction, which then commits: the failure is recorded and
    the lock released at one instant. When the lock session is gone, it is written from
    a fresh session instead; mark_failed only touches the run if this attempt still
    owns it, so a successor is never overwritten.

    In the lease mode (no ``lock_conn``; ``fence``: the attempt's) it is written in a fenced
    transaction on a borrowed connection; once the lease is lost, from a fresh session as
    above.
    """
    if attempt_id is None:  # the start itself failed: nothing was recorded yet
        record_refused_start(lock_conn, exc, spec, records, log)
        return
    outcome: AttemptOutcome = "lock_lost" if isinstance(exc, LockLostError) else "failed"
    error = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:4000]
    log.error("%s: %s", outcome, error)
    _count(spec, outcome)

    def write(conn: psycopg.Connection) -> None:
        # the run's row before the attempt's, the order of every transaction that locks both
        # (a successor's start_attempt, the completion): else each waits for the other
        if not spec.options.dry_run:
            records.mark_failed(conn, attempt_id, error)
        records.finish_attempt(conn, attempt_id, outcome, error=error)

    _end_attempt(lock_conn, spec, log, write, fence)


def record_deferral(
    lock_conn: psycopg.Connection | None,
    spec: RunSpec,
    records: RunRecords,
    log: RunLogger,
    attempt_id: int,
    fence: Fence | None = None,
) -> None:
    """The work deferred (:class:`~airflow_idempotency.run_steps.WorkDeferred`): mark the
    attempt ``deferred`` and leave the run ``started`` (its resumption is a new attempt of
    the key), written as a failure is (:func:`record_failure`), so that the lock is
    released at the same instant."""
    log.info(
        "deferred: this attempt ends here, the run stays started and its lock is released; "
        "the resumed task runs as a new attempt of the key"
    )
    _count(spec, "deferred")

    def write(conn: psycopg.Connection) -> None:
        records.finish_attempt(conn, attempt_id, "deferred")

    _end_attempt(lock_conn, spec, log, write, fence)


def _end_attempt(
    lock_conn: psycopg.Connection | None,
    spec: RunSpec,
    log: RunLogger,
    write: Callable[[psycopg.Connection], None],
    fence: Fence | None,
) -> None:
    """``write`` the attempt's end: in the lock transaction (advisory mode), in a fenced
    transaction (lease mode, ``fence``), else from a fresh session."""
    if lock_conn is None:
        if fence is not None and _write_fenced(spec, fence, write):
            return
    elif _write_in_lock_transaction(lock_conn, spec, write):
        return
    _write_fresh(spec, log, write)


def _write_fenced(spec: RunSpec, fence: Fence, write: Callable[[psycopg.Connection], None]) -> bool:
    """The lease mode: ``write`` in a fenced transaction on a borrowed connection; False when
    the lease is lost (or the database unreachable)."""
    try:
        with (
            autocommit_connection(spec.connect) as conn,
            fence.transaction(conn, bound_locks=True),
        ):
            write(conn)
        return True
    except (psycopg.Error, IdempotencyError):
        return False


def _write_in_lock_transaction(
    lock_conn: psycopg.Connection, spec: RunSpec, write: Callable[[psycopg.Connection], None]
) -> bool:
    """The advisory mode: ``write`` in the lock transaction, which then commits (the failure
    and the lock's release, at once); False when the lock session is gone or aborted."""
    if lock_conn.closed or lock_conn.broken:
        return False
    try:
        if lock_conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
            write(lock_conn)
            lock_conn.execute("COMMIT")  # the failure and the lock's release, at once
        else:  # the lock transaction already ended (a completion that found no row)
            with bounded_transaction(lock_conn, spec.environment.schema):
                write(lock_conn)
        return True
    except psycopg.Error:
        # Terminated server-side (psycopg only learns it from a failed statement),
        # or the lock transaction is aborted: give it up, write from a fresh one.
        with contextlib.suppress(psycopg.Error):
            lock_conn.execute("ROLLBACK")
        return False


def _write_fresh(
    spec: RunSpec, log: RunLogger, write: Callable[[psycopg.Connection], None]
) -> None:
    """``write`` from a fresh session (the lock session or the lease is gone); a failure to
    write is logged, never raised over the run's own error."""
    try:
        with (
            autocommit_connection(spec.connect) as conn,
            bounded_transaction(conn, spec.environment.schema),
        ):
            write(conn)  # READ COMMITTED: autocommit_connection pins it
    except (psycopg.Error, IdempotencyError) as record_exc:
        log.warning(
            "could not record how the attempt ended (%s); job_runs may still say started",
            record_exc,
        )
