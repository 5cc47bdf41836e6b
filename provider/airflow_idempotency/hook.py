"""The Postgres connection where run records, locks and the ledger live."""

from __future__ import annotations

from typing import Any

import psycopg
from airflow.providers.postgres.hooks.postgres import PostgresHook
from psycopg.rows import tuple_row


class IdempotencyHook(PostgresHook):
    """A :class:`PostgresHook` that hands out dedicated psycopg 3 connections.

    Any connection of type ``postgres`` works; ``idempotency_default`` is the default id.
    Each call of :meth:`new_connection` opens a new session: the run lock needs one of
    its own for the whole run (``PostgresHook.run()`` would release it at once).
    """

    conn_name_attr = "postgres_conn_id"
    default_conn_name = "idempotency_default"
    conn_type = "idempotency_postgres"
    hook_name = "Idempotency (Postgres)"

    def new_connection(self) -> psycopg.Connection[Any]:
        """Open a new psycopg 3 connection (use it as a context manager: it closes on exit)."""
        conn = self.get_conn()
        if not isinstance(conn, psycopg.Connection):
            conn.close()
            raise RuntimeError(
                "airflow-provider-idempotency needs psycopg 3: install 'psycopg[binary]>=3.2' "
                "and SQLAlchemy 2 so that the postgres provider uses it"
            )
        conn.row_factory = tuple_row  # a 'cursor' extra on the connection must not change ours
        return conn
