"""Transactions begun with an explicit ``BEGIN``, so that their isolation level is chosen here.

psycopg's ``conn.transaction()`` begins with the connection's own attributes, and a plain
``BEGIN`` takes the database's or role's ``default_transaction_isolation``. The provider's own
transactions are READ COMMITTED whatever that default is (REPEATABLE READ would fix one snapshot
per transaction: a lock transaction would hold back vacuum for the whole run and miss the
run's own start); a user's work transactions get the level the user asks for.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import IsolationLevel

from airflow_idempotency._sql import query
from airflow_idempotency.locks import lock_wait_ms

log = logging.getLogger(__name__)

READ_COMMITTED = "BEGIN ISOLATION LEVEL READ COMMITTED"
PIPELINE_SUPPORTED = psycopg.Pipeline.is_supported()  # libpq >= 14 (the binary wheels' is newer)


def begin_statement(isolation_level: IsolationLevel | None, read_only: bool) -> str:
    """``BEGIN`` with the given options; ``None`` keeps the server's default level."""
    parts = ["BEGIN"]
    if isolation_level is not None:
        parts += ["ISOLATION LEVEL", IsolationLevel(isolation_level).name.replace("_", " ")]
    if read_only:
        parts.append("READ ONLY")
    return " ".join(parts)


def pipelined(conn: psycopg.Connection) -> contextlib.AbstractContextManager[Any]:
    """A pipeline in which statements go out together (one round trip), unless one is open."""
    if not PIPELINE_SUPPORTED or conn.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF:
        return contextlib.nullcontext()
    return conn.pipeline()


def rollback_quietly(conn: psycopg.Connection) -> None:
    """End a failed transaction; a connection that is gone has nothing left to roll back."""
    if conn.closed or conn.broken:
        return
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        return
    try:
        conn.execute("ROLLBACK")
    except psycopg.Error as exc:
        log.warning("could not roll back (%s): the session is gone", exc)


def in_one_transaction(
    conn: psycopg.Connection,
    statements: Sequence[tuple[str, Mapping[str, Any]]],
    *,
    begin: str = READ_COMMITTED,
) -> list[psycopg.Cursor[Any]]:
    """Run ``statements`` in one transaction on an idle autocommit connection: its BEGIN on a
    round trip of its own, then the statements and the COMMIT sent together; return their
    cursors, results fetched.

    The BEGIN goes alone because it is where a connection pooler makes a client wait for a
    server connection: when its wait times out (PgBouncer's ``query_wait_timeout``) it sends
    its error and closes the connection, and in pipeline mode libpq reports only the closed
    connection, not the pooler's error (see ``locks.pooler_refusal``).
    """
    try:
        conn.execute(begin)
        with pipelined(conn):
            cursors = [conn.execute(statement, params) for statement, params in statements]
            conn.execute("COMMIT")
    except BaseException:
        rollback_quietly(conn)
        raise
    return cursors


@contextlib.contextmanager
def explicit_transaction(
    conn: psycopg.Connection,
    begin: str,
    first: Sequence[tuple[str, Mapping[str, Any]]],
    last: tuple[str, Mapping[str, Any]],
) -> Iterator[None]:
    """A transaction begun with ``begin``: its ``first`` statements go out with the BEGIN,
    its ``last`` with the COMMIT (no round trip of their own). Committed when the block ends,
    rolled back when the block (or the COMMIT itself) raises."""
    try:
        with pipelined(conn):
            conn.execute(begin)
            for statement, params in first:
                conn.execute(statement, params)
        yield
        with pipelined(conn):
            conn.execute(*last)
            conn.execute("COMMIT")
    except BaseException:
        rollback_quietly(conn)
        raise


@contextlib.contextmanager
def bounded_transaction(conn: psycopg.Connection, schema: str) -> Iterator[None]:
    """``conn.transaction()`` for the provider's own statements (a savepoint inside an open
    transaction), every lock wait in it bounded by ``locks.lock_wait_ms`` (``lock_timeout``
    for this transaction only)."""
    with conn.transaction():
        conn.execute(query("bound_lock_waits", schema), {"lock_wait_ms": lock_wait_ms()})
        yield
