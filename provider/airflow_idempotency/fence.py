"""The fence's Python (fenced transactions, errors); its SQL: migrations 0006, 0008, 0010, 0012+.

A fenced transaction on a connection of one attempt, and what its errors mean (:class:`Fence`).
The fence itself is SQL (migrations 0006, 0008, 0010, 0012 and 0013, the ``fence_enter``/
``fence_arm``/``fence_take_over`` queries of ``sql/queries.sql``); docs/fence.md says what it
guarantees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import IsolationLevel

from airflow_idempotency._sql import query
from airflow_idempotency._transactions import begin_statement, explicit_transaction
from airflow_idempotency.exceptions import (
    InvalidInputError,
    LockLostError,
    LockWaitError,
    TransactionMisuseError,
    WorkConflictError,
)
from airflow_idempotency.locks import (
    LOCK_WAIT_ENV,
    RunLock,
    lock_wait_ms,
    pooler_refusal,
    server_keepalive_settings,
)

FENCE_SQLSTATE = "IF001"
"""What the fence raises (migration 0006): this attempt's run lock is no longer held."""
FENCE_WAIT_SQLSTATE = "IF002"
"""The fence's bounded wait ended (migration 0008): the message names the sessions."""
FENCE_PREPARE_SQLSTATE = "IF003"
"""A fenced transaction was to be prepared for a two-phase commit (migration 0008)."""
FENCE_EARLY_SQLSTATE = "IF004"
"""The commit-time check fired before COMMIT (SET CONSTRAINTS ALL IMMEDIATE; migration 0010)."""


def fence_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is the fence refusing a transaction."""
    seen: BaseException | None = exc
    for _ in range(10):  # a chain of causes, never a cycle in practice; bounded anyway
        if seen is None:
            return False
        if isinstance(seen, psycopg.Error) and seen.sqlstate == FENCE_SQLSTATE:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _sqlstate(exc: BaseException) -> str | None:
    return exc.sqlstate if isinstance(exc, psycopg.Error) else None


def fence_sqlstate(exc: BaseException) -> bool:
    """Whether ``exc`` is one of the fence's own errors (IF001 to IF004)."""
    return _sqlstate(exc) in (
        FENCE_SQLSTATE,
        FENCE_WAIT_SQLSTATE,
        FENCE_PREPARE_SQLSTATE,
        FENCE_EARLY_SQLSTATE,
    )


def lock_wait_refusal(
    exc: BaseException, waiter: str, holders: list[str] | None = None
) -> LockWaitError | None:
    """The error to raise when ``exc`` is a bounded lock wait of the provider's own statements
    that ended (``waiter`` says whose; ``holders``: who held the bookkeeping tables then, see
    :func:`bookkeeping_lock_holders`), else ``None``."""
    if _sqlstate(exc) == FENCE_WAIT_SQLSTATE:
        assert isinstance(exc, psycopg.Error)
        hint = exc.diag.message_hint or ""
        return LockWaitError(f"{waiter}: {_first_line(exc)}. {hint}".strip())
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        if holders is None:
            held_by = "another session"
        else:
            held_by = "; ".join(holders) or "another session, which has let go since"
        return LockWaitError(
            f"{waiter} waited {lock_wait_ms()} ms for a lock on the bookkeeping tables "
            f"({_first_line(exc)}), held by {held_by}: a migration or an ALTER waiting behind "
            "a long reader, a report or a dump holding a table, or an operator's reset of this "
            "key. Nothing of this transaction was written; a retry converges. pg_stat_activity "
            "(wait_event_type Lock, pg_blocking_pids) names the holder; raise "
            f"{LOCK_WAIT_ENV} (seconds) if such waits are expected."
        )
    return None


def bookkeeping_lock_holders(conn: psycopg.Connection, schema: str) -> list[str]:
    """Who holds or awaits a lock on the bookkeeping tables that their statements queue
    behind, one line each (pid, application_name, mode, table): for an error message."""
    found = conn.execute(query("bookkeeping_lock_holders", schema), {"schema": schema})
    return [str(holder) for (holder,) in found.fetchall()]


_IDLE = psycopg.pq.TransactionStatus.IDLE


class Fence:
    """The fence of one attempt of (``job_name``, ``run_key``), which holds ``lock``: its
    transactions commit only while the lock is held (:meth:`transaction`), and their errors
    are named for what they mean (:meth:`translate_error`)."""

    def __init__(
        self, lock: RunLock, attempt_id: int, schema: str, job_name: str, run_key: str
    ) -> None:
        self.lock = lock
        self.attempt_id = attempt_id
        self.schema = schema
        self.job_name = job_name
        self.run_key = run_key

    @contextlib.contextmanager
    def transaction(
        self,
        conn: psycopg.Connection,
        *,
        isolation_level: IsolationLevel | None = None,
        read_only: bool = False,
        bound_locks: bool = False,
    ) -> Iterator[None]:
        """A transaction on ``conn`` (a connection of this attempt) that is fenced:

        - its first statement (sent with its BEGIN: no extra round trip) checks that this
          attempt's lock transaction still holds the run lock, holds the key's fence lock
          until the transaction ends (so a successor taking the key over waits for it), and
          arms a check that runs at COMMIT. It never queues behind a takeover (the lock has
          changed hands then: it fails at once), and any other wait is bounded;
        - its COMMIT fails (and nothing it wrote lands) if the run lock was lost meanwhile:
          the check armed when it began, and again by a statement sent with the COMMIT (so
          that it also runs after the transaction's own deferred triggers);
        - the server drops it within the dead-peer bound if this worker is cut off.

        Inside a transaction already open on ``conn`` (the work's own psycopg transaction, a
        dry run's) it is a savepoint, fenced the same way: the check runs at that
        transaction's COMMIT. A transaction the block ended itself (a COMMIT, ROLLBACK or
        PREPARE TRANSACTION of its own) raises :class:`TransactionMisuseError`; a PREPARE is
        refused by the fence itself. ``bound_locks``: every lock wait of the transaction is
        bounded (the provider's own statements), not only the fence's.

        Raises psycopg errors; :meth:`translate_error` names them (the fence's refusal is
        SQLSTATE ``IF001``).
        """
        self.refuse_if_known_lost()
        params = self.params(conn)
        first = [(query("fence_enter", self.schema), params)]
        if bound_locks:
            first.append((query("bound_lock_waits", self.schema), params))
        arm = (query("fence_arm", self.schema), params)
        if conn.info.transaction_status == _IDLE:
            try:
                begin = begin_statement(isolation_level, read_only)
            except ValueError as exc:
                raise InvalidInputError(f"unknown isolation level {isolation_level!r}") from exc
            with explicit_transaction(conn, begin, first, arm):
                yield
                self._still_open(conn)
        else:
            with conn.transaction():
                for statement, statement_params in first:
                    conn.execute(statement, statement_params)
                yield
                self._still_open(conn)
                conn.execute(*arm)

    def _still_open(self, conn: psycopg.Connection) -> None:
        """Raise if the block ended its own transaction: what followed ran unfenced."""
        if conn.closed or conn.info.transaction_status != _IDLE:
            return
        raise TransactionMisuseError(
            f"job {self.job_name!r} run_key {self.run_key!r}: the work ended its fenced "
            "transaction inside the block (a COMMIT, ROLLBACK or PREPARE TRANSACTION of its "
            "own): its statements after that ran outside the fence, each committed at once. "
            "Leave the block to commit (the fence commits it), raise to roll back, and use "
            "savepoints (connection.transaction()) inside it."
        )

    def refuse_if_known_lost(self) -> None:
        """Raise :class:`LockLostError` when the lease's heartbeat found it lost: a fenced
        transaction is refused before its BEGIN."""
        if self.lock.known_lost:
            raise LockLostError(
                f"the lock of job {self.job_name!r} run_key {self.run_key!r} is no longer held by "
                f"attempt {self.attempt_id} ({self.lock.describe()}), so it may not begin another "
                "transaction. A rerun will pick the key up again."
            )

    def params(self, conn: psycopg.Connection) -> dict[str, Any]:
        """The parameters of the fence's statements (fence_enter, fence_arm) on ``conn``."""
        return {
            **self.lock.params,
            "attempt_id": self.attempt_id,
            "lock_wait_ms": lock_wait_ms(),
            **server_keepalive_settings(conn),
        }

    def translate_error(self, exc: psycopg.Error, conn: psycopg.Connection) -> BaseException:
        """The error to raise for ``exc``, raised by a fenced transaction on ``conn``."""
        refusal = pooler_refusal(exc)
        if refusal is not None:
            return refusal
        waited = lock_wait_refusal(exc, f"job {self.job_name!r} run_key {self.run_key!r}")
        if _sqlstate(exc) == FENCE_WAIT_SQLSTATE and waited is not None:
            return waited
        if _sqlstate(exc) == FENCE_PREPARE_SQLSTATE:
            return TransactionMisuseError(
                f"job {self.job_name!r} run_key {self.run_key!r}: a fenced transaction may not "
                f"be prepared for a two-phase commit ({_first_line(exc)}): COMMIT PREPARED runs "
                "no check, so it could land after the run lock is lost. Nothing was prepared "
                "or committed; commit the work's transactions directly (leave the block)."
            )
        if _sqlstate(exc) == FENCE_EARLY_SQLSTATE:
            return TransactionMisuseError(
                f"job {self.job_name!r} run_key {self.run_key!r}: the fence's commit-time check "
                f"was made to run before COMMIT ({_first_line(exc)}), so the COMMIT itself would "
                "run none and could land after the run lock is lost. Nothing was committed; name "
                "the work's own constraints in SET CONSTRAINTS (not ALL) around its fenced "
                "transactions."
            )
        if fence_refused(exc):
            return LockLostError(
                f"the lock of job {self.job_name!r} run_key {self.run_key!r} is no longer held by "
                f"attempt {self.attempt_id} ({self.lock.describe()}), so its transaction did "
                "not commit "
                f"({_first_line(exc)}). A rerun will pick the key up again."
            )
        if isinstance(exc, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected):
            return WorkConflictError(
                f"job {self.job_name!r} run_key {self.run_key!r}: the work's transaction "
                f"conflicted with a concurrent one and was rolled back ({_first_line(exc)}). "
                "Nothing of it committed; a retry converges."
            )
        if isinstance(exc, psycopg.OperationalError) and (conn.closed or conn.broken):
            return LockLostError(
                f"job {self.job_name!r} run_key {self.run_key!r} lost its connection to the job "
                f"database ({_first_line(exc)}): this transaction is rolled back, unless the "
                "connection was lost at its COMMIT (it may then have committed), and this "
                "attempt cannot know whether it still holds its lock. A rerun converges. (A "
                "connection pooler whose pool is exhausted also closes connections, after its "
                "query_wait_timeout: see docs/deploying.md, pool sizing.)"
            )
        return exc  # e.g. a cancelled statement or a constraint: the session is fine
