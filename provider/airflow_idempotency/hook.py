"""The Postgres connection where run records, locks and the ledger live."""

from __future__ import annotations

from typing import Any

import psycopg
from airflow.providers.postgres.hooks.postgres import PostgresHook
from psycopg.rows import tuple_row

from airflow_idempotency.connection import hook_connect_kwargs, lock_options
from airflow_idempotency.schema import DEFAULT_CONN_ID


class IdempotencyHook(PostgresHook):
    """A :class:`PostgresHook` that hands out dedicated psycopg 3 connections.

    Any connection of type ``postgres`` works; ``idempotency_default`` is the default id.
    Each call of :meth:`new_connection` opens a new session: the run lock needs one of
    its own for the whole run (``PostgresHook.run()`` would release it at once).

    The connection is opened here, with psycopg 3, from the same arguments
    ``PostgresHook.get_conn()`` builds: host, port, login, password, schema (the database),
    every extra that is a libpq parameter (``sslmode``, ``sslrootcert``,
    ``application_name``, ``connect_timeout``, ``options``, ``keepalives_*``,
    ``tcp_user_timeout``, ...), and the AWS or Azure IAM token when the extra ``iam`` asks
    for one (through the postgres provider, so its amazon/azure provider must be
    installed). That is the same on Airflow 2.11, where ``get_conn()`` would return
    psycopg2 (SQLAlchemy 1.4), and on 3.x. Not used: the ``cursor`` extra (the provider's
    statements read plain tuples) and ``enable_log_db_messages``.
    Libpq's TCP keepalive settings default to
    :data:`~airflow_idempotency.locks.DEAD_PEER_DEFAULTS`, and ``connect_timeout`` to
    :data:`~airflow_idempotency.connection.CONNECT_TIMEOUT`, unless the extra sets them.

    The operator and the decorator open their connections through
    :class:`~airflow_idempotency.connection.JobDatabase` (the same arguments, without this
    hook's imports; for an IAM token it imports the postgres provider's hook).
    """

    conn_name_attr = "postgres_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = "idempotency_postgres"
    hook_name = "Idempotency (Postgres)"

    def connection_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``psycopg.connect`` for this Airflow connection
        (:func:`~airflow_idempotency.connection.hook_connect_kwargs`: with the IAM token)."""
        return hook_connect_kwargs(
            self.connection,
            self,
            database=getattr(self, "database", None),
            options=getattr(self, "options", None),
        )

    def lock_options(self) -> dict[str, Any]:
        """``lock_mode`` for ``run_idempotently``, from this connection's extra ``lock_mode``
        and ``lease_ttl`` (:func:`~airflow_idempotency.connection.lock_options`)."""
        return lock_options(self.connection)

    def new_connection(self) -> psycopg.Connection[Any]:
        """Open a new psycopg 3 connection (use it as a context manager: it closes on exit)."""
        return psycopg.connect(**self.connection_kwargs(), row_factory=tuple_row)
