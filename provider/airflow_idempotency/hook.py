"""The Postgres connection where run records, locks and the ledger live."""

from __future__ import annotations

import copy
from typing import Any

import psycopg
from airflow.providers.postgres.hooks.postgres import PostgresHook
from psycopg.rows import tuple_row

from airflow_idempotency.locks import DEAD_PEER_DEFAULTS
from airflow_idempotency.schema import DEFAULT_CONN_ID

CONNECT_TIMEOUT = 10  # seconds, unless the connection's extra sets connect_timeout

# Extras of the Airflow connection that are the postgres provider's own options, not
# libpq's: never passed to psycopg.connect (the provider's own list, where it has one).
_HOOK_EXTRAS = frozenset(
    getattr(PostgresHook, "ignored_extra_options", set())
    | {"iam", "redshift", "redshift-serverless", "aws_conn_id", "azure_conn_id", "cursor"}
    | {"cluster-identifier", "workgroup-name", "sqlalchemy_scheme", "sqlalchemy_query"}
)


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
    :data:`CONNECT_TIMEOUT`, unless the extra sets them.
    """

    conn_name_attr = "postgres_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = "idempotency_postgres"
    hook_name = "Idempotency (Postgres)"

    def connection_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``psycopg.connect`` for this Airflow connection."""
        conn = copy.deepcopy(self.connection)
        extra = conn.extra_dejson
        if extra.get("iam", False):
            conn.login, conn.password, conn.port = self.get_iam_token(conn)
        kwargs: dict[str, Any] = {
            "host": conn.host,
            "user": conn.login,
            "password": conn.password,
            "dbname": getattr(self, "database", None) or conn.schema,
            "port": conn.port,
        }
        if getattr(self, "options", None):
            kwargs["options"] = self.options
        kwargs.update((k, v) for k, v in extra.items() if k not in _HOOK_EXTRAS)
        for name, value in DEAD_PEER_DEFAULTS.items():
            kwargs.setdefault(name, value)
        # A worker cut off from the database must not wait two minutes (Linux's SYN
        # retries) in every new connection, e.g. the one that records its failure.
        kwargs.setdefault("connect_timeout", CONNECT_TIMEOUT)
        return {k: v for k, v in kwargs.items() if v is not None and v != ""}

    def new_connection(self) -> psycopg.Connection[Any]:
        """Open a new psycopg 3 connection (use it as a context manager: it closes on exit)."""
        return psycopg.connect(**self.connection_kwargs(), row_factory=tuple_row)
