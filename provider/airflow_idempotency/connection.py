"""The job database's psycopg 3 connections, from an Airflow connection id.

:class:`JobDatabase` is what the operator, the decorator and notifications open their
connections with: it reads the Airflow connection (``BaseHook.get_connection``: the
secrets backends, the Task SDK's API) and opens psycopg 3 sessions from it, without
importing the Postgres provider's hook (with SQLAlchemy, psycopg2 and sqlparse: about 60 ms
in a task process; the no-op decision of ``python3 dev.py bench --only partitions_e2e``
went from 201 to 43 ms). A
connection whose extra asks for an IAM token (``iam``) gets it from the postgres provider's
hook, imported then. :class:`~airflow_idempotency.hook.IdempotencyHook` builds the same
arguments (:func:`connect_kwargs`).
"""

from __future__ import annotations

import copy
from functools import cache, cached_property
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from airflow_idempotency.leases import LockMode, check_lease_ttl, check_lock_mode
from airflow_idempotency.locks import DEAD_PEER_DEFAULTS
from airflow_idempotency.schema import DEFAULT_CONN_ID

CONNECT_TIMEOUT = 10  # seconds, unless the connection's extra sets connect_timeout

HOOK_EXTRAS = frozenset(
    {"iam", "redshift", "redshift-serverless", "aws_conn_id", "azure_conn_id", "cursor"}
    | {"cluster-identifier", "workgroup-name", "sqlalchemy_scheme", "sqlalchemy_query"}
)
"""Extras of a postgres connection that are the postgres provider's own options, not
libpq's (its ``PostgresHook.ignored_extra_options``): never passed to ``psycopg.connect``."""

PROVIDER_EXTRAS = frozenset({"lock_mode", "lease_ttl"})
"""Extras that are this provider's own options for the job database, never libpq's: how its
runs hold their keys (``lock_mode``: ``advisory`` or ``lease``; ``lease_ttl``: seconds),
:func:`lock_options`."""


def lock_options(conn: Any) -> dict[str, Any]:
    """``lock_mode`` of ``run_idempotently`` (a :class:`~airflow_idempotency.leases.LockMode`)
    from the Airflow connection's extra ``lock_mode`` and ``lease_ttl`` (checked: a bad value
    is a :class:`~airflow_idempotency.exceptions.ConfigurationError` naming the allowed ones)."""
    extra = conn.extra_dejson
    where = f"the extra of Airflow connection {getattr(conn, 'conn_id', None)!r}"
    mode = check_lock_mode(extra.get("lock_mode"), f"{where}: lock_mode")
    ttl = check_lease_ttl(extra.get("lease_ttl"), f"{where}: lease_ttl")
    return {"lock_mode": LockMode(mode, ttl)}


def connect_kwargs(
    conn: Any,
    *,
    database: str | None = None,
    options: str | None = None,
    ignored: frozenset[str] = HOOK_EXTRAS,
) -> dict[str, Any]:
    """The keyword arguments of ``psycopg.connect`` for the Airflow connection ``conn``.

    Host, port, login, password, schema (the database, unless ``database``), ``options``,
    and every extra that is a libpq parameter (``sslmode``, ``sslrootcert``,
    ``application_name``, ``connect_timeout``, ``keepalives_*``, ``tcp_user_timeout``,
    ...). Libpq's TCP keepalive settings default to
    :data:`~airflow_idempotency.locks.DEAD_PEER_DEFAULTS` and ``connect_timeout`` to
    :data:`CONNECT_TIMEOUT`, unless the extra sets them: a worker cut off from the database
    must not wait two minutes (Linux's SYN retries) in every new connection, e.g. the one
    that records its failure.
    """
    kwargs: dict[str, Any] = {
        "host": conn.host,
        "user": conn.login,
        "password": conn.password,
        "dbname": database or conn.schema,
        "port": conn.port,
    }
    if options:
        kwargs["options"] = options
    kwargs.update(
        (k, v)
        for k, v in conn.extra_dejson.items()
        if k not in ignored and k not in PROVIDER_EXTRAS
    )
    for name, value in DEAD_PEER_DEFAULTS.items():
        kwargs.setdefault(name, value)
    kwargs.setdefault("connect_timeout", CONNECT_TIMEOUT)
    return {k: v for k, v in kwargs.items() if v is not None and v != ""}


def hook_connect_kwargs(
    conn: Any,
    hook: Any = None,
    *,
    database: str | None = None,
    options: str | None = None,
) -> dict[str, Any]:
    """:func:`connect_kwargs` as ``PostgresHook`` reads the connection ``conn``: the extras
    this version of the postgres provider lists as its own are left out too, and when the
    extra ``iam`` asks for it, login, password (the token) and port come from the AWS or
    Azure provider, through ``hook`` (a ``PostgresHook`` of ``conn``: one is made when
    none is given). Imports the postgres provider's hook."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    if conn.extra_dejson.get("iam", False):
        hook = hook or PostgresHook(postgres_conn_id=conn.conn_id)
        conn = copy.deepcopy(conn)
        conn.login, conn.password, conn.port = hook.get_iam_token(conn)
    return connect_kwargs(conn, database=database, options=options, ignored=_hook_extras())


@cache
def _hook_extras() -> frozenset[str]:
    """:data:`HOOK_EXTRAS` and the extras the installed postgres provider lists as its own."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    return HOOK_EXTRAS | frozenset(getattr(PostgresHook, "ignored_extra_options", ()))


class JobDatabase:
    """The job database of the Airflow connection ``conn_id`` (type ``postgres``).

    Each call of :meth:`new_connection` opens a new session: the run lock needs one of its
    own for the whole run. The Airflow connection is looked up once, on first use.
    """

    def __init__(self, conn_id: str = DEFAULT_CONN_ID) -> None:
        self.conn_id = conn_id

    @cached_property
    def connection(self) -> Any:
        """The Airflow connection (raises Airflow's "not defined" error when it is not)."""
        from airflow.providers.common.compat.sdk import BaseHook

        return BaseHook.get_connection(self.conn_id)

    @cached_property
    def lock_options(self) -> dict[str, Any]:
        """How runs on this database hold their keys: ``lock_mode`` for ``run_idempotently``,
        from the connection's extra ``lock_mode`` and ``lease_ttl`` (:func:`lock_options`)."""
        return lock_options(self.connection)

    @cached_property
    def _iam(self) -> bool:
        return bool(self.connection.extra_dejson.get("iam", False))

    @cached_property
    def _kwargs(self) -> dict[str, Any]:
        return connect_kwargs(self.connection)

    def connection_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``psycopg.connect`` (see :func:`connect_kwargs`); with
        an IAM token, a fresh one each time (they expire), through the postgres provider."""
        if self._iam:
            return hook_connect_kwargs(self.connection)
        return dict(self._kwargs)

    def new_connection(self) -> psycopg.Connection[Any]:
        """Open a new psycopg 3 connection (use it as a context manager: it closes on exit)."""
        return psycopg.connect(**self.connection_kwargs(), row_factory=tuple_row)
