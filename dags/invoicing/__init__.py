"""The invoice-finalization example: its SQL and the work of each task.

Everything here is plain Python over a psycopg connection; the DAG files wire it into
``@task.idempotent_run`` tasks. Kept out of the DAG files so tests, the demo and the
benchmarks call the very same code.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from functools import cache
from pathlib import Path
from typing import Any

import psycopg

HERE = Path(__file__).parent
_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
# Serialises concurrent creation of the example schema: an advisory lock named by its text.
_SCHEMA_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('invoicing.schema', 0))"


@cache
def queries() -> dict[str, str]:
    """The statements of queries.sql, by the name on the ``-- name: NAME`` line before each."""
    parts = _NAME.split((HERE / "queries.sql").read_text(encoding="utf-8"))
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def one_row(cur: psycopg.Cursor[Any]) -> tuple[Any, ...]:
    """The one row the statement just executed on ``cur`` returns (each of queries.sql's
    counting statements returns exactly one)."""
    row = cur.fetchone()
    if row is None:
        raise RuntimeError("the statement returned no row: queries.sql and the code disagree")
    return tuple(row)


def ensure_example_schema(conn: psycopg.Connection) -> None:
    """Create the example tables once per version of schema.sql (safe with many workers).

    The DDL runs only when this version of schema.sql was never applied to the database,
    not at the start of every task: even a ``CREATE INDEX IF NOT EXISTS`` of an index that
    exists takes a SHARE lock on its table, and a task doing that while another date's
    task writes ``orders`` and ``invoices`` deadlocks the two (seen in a backfill). Applied
    versions are recorded in ``invoicing_schema`` by the SHA-256 of the file; deploy a
    changed file when no run is writing.
    """
    ddl = (HERE / "schema.sql").read_bytes()
    digest = hashlib.sha256(ddl).hexdigest()
    if _schema_applied(conn, digest):
        return
    with conn.transaction():
        conn.execute(_SCHEMA_LOCK)
        if _schema_applied(conn, digest):  # another worker applied it while we waited
            return
        conn.execute(ddl)
        conn.execute("INSERT INTO invoicing_schema (digest) VALUES (%s)", (digest,))


def _schema_applied(conn: psycopg.Connection, digest: str) -> bool:
    # Inside a transaction (or without autocommit) the probe gets a savepoint (or a
    # transaction) of its own, so a missing table leaves nothing aborted.
    idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    probe = contextlib.nullcontext() if conn.autocommit and idle else conn.transaction()
    try:
        with probe:
            found = conn.execute(
                "SELECT 1 FROM invoicing_schema WHERE digest = %s", (digest,)
            ).fetchone()
    except psycopg.errors.UndefinedTable:
        return False
    return found is not None
