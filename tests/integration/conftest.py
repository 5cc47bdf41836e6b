"""The fixtures the integration tests share: a database of its own for each adversary's attack
(tests/integration/test_lease_adversary*.py)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from airflow_idempotency.schema import ensure_schema
from devtools.postgres import PostgresServer, temporary_database


@pytest.fixture
def adv_db(pg_server: PostgresServer) -> Iterator[str]:
    """A fresh database with the bookkeeping schema and ``public.facts`` the work writes to."""
    with temporary_database(pg_server, "lease_adv") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ensure_schema(conn)
            conn.execute("CREATE TABLE public.facts (writer text NOT NULL, k text)")
        yield dsn
