"""The fence's Python: fenced transactions and their errors; its SQL is migration 0006_fence.

A fenced transaction on a connection of one attempt, and what its errors mean (:class:`Fence`).
The fence itself is SQL (migration 0006, the ``fence_enter``/``fence_arm`` queries of
``sql/queries.sql``); docs/fence.md says what it guarantees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import IsolationLevel

from airflow_idempotency._sql import query
from airflow_idempotency._transactions import begin_statement, explicit_transaction
from airflow_idempotency.exceptions import InvalidInputError, LockLostError, WorkConflictError
from airflow_idempotency.locks import RunLock, pooler_refusal, server_keepalive_settings

FENCE_SQLSTATE = "IF001"
"""What the fence raises (migration 0006): this attempt's run lock is no longer held."""


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
    ) -> Iterator[None]:
        """A transaction on ``conn`` (a connection of this attempt) that is fenced:

        - its first statement (sent with its BEGIN: no extra round trip) checks that this
          attempt's lock session still holds the run lock, and holds the key's fence lock
          until the transaction ends, so a successor taking the key over waits for it;
        - its COMMIT fails (and nothing it wrote lands) if the run lock was lost meanwhile:
          a statement sent with the COMMIT arms a check that runs at COMMIT, after the
          transaction's own deferred triggers;
        - the server drops it within the dead-peer bound if this worker is cut off.

        Raises psycopg errors; :meth:`translate_error` names them (the fence's refusal is
        SQLSTATE ``IF001``). Inside a dry run's transaction it is a savepoint.
        """
        params = self._params(conn)
        enter = (query("fence_enter", self.schema), params)
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            try:
                begin = begin_statement(isolation_level, read_only)
            except ValueError as exc:
                raise InvalidInputError(f"unknown isolation level {isolation_level!r}") from exc
            arm = (query("fence_arm", self.schema), params)
            with explicit_transaction(conn, begin, enter, arm):
                yield
        else:  # a dry run's transaction, rolled back in the end: nothing to arm
            with conn.transaction():
                conn.execute(*enter)
                yield

    def _params(self, conn: psycopg.Connection) -> dict[str, Any]:
        return {
            **self.lock.params,
            "attempt_id": self.attempt_id,
            **server_keepalive_settings(conn),
        }

    def translate_error(self, exc: psycopg.Error, conn: psycopg.Connection) -> BaseException:
        """The error to raise for ``exc``, raised by a fenced transaction on ``conn``."""
        refusal = pooler_refusal(exc)
        if refusal is not None:
            return refusal
        if fence_refused(exc):
            return LockLostError(
                f"the lock of job {self.job_name!r} run_key {self.run_key!r} is no longer held by "
                f"attempt {self.attempt_id} (its session, backend pid {self.lock.backend_pid}, "
                f"ended), so its transaction did not commit ({_first_line(exc)}). A rerun "
                "will pick the key up again."
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
                f"database ({_first_line(exc)}): this transaction did not commit, and this "
                "attempt cannot know whether it still holds its lock. A rerun converges. (A "
                "connection pooler whose pool is exhausted also closes connections, after its "
                "query_wait_timeout: see docs/deploying.md, pool sizing.)"
            )
        return exc  # e.g. a cancelled statement or a constraint: the session is fine
