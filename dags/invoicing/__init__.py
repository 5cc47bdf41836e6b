"""The invoice-finalization example: its SQL and the work of each task.

Everything here is plain Python over a psycopg connection; the DAG files wire it into
``@task.idempotent_run`` tasks. Kept out of the DAG files so tests, the demo and the
benchmarks call the very same code.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import psycopg

from airflow_idempotency import named_queries

HERE = Path(__file__).parent
# Serialises concurrent creation of the example schema (any constant would do).
_SCHEMA_LOCK = 0x1A7C0_0001


@cache
def queries() -> dict[str, str]:
    """The statements of queries.sql, by name."""
    return named_queries((HERE / "queries.sql").read_text(encoding="utf-8"))


def ensure_example_schema(conn: psycopg.Connection) -> None:
    """Create the example tables if missing (safe when several workers do it at once)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
        conn.execute((HERE / "schema.sql").read_bytes())
