"""Create and migrate the bookkeeping tables, safely when many workers start at once.

The tables live in one schema (``idempotency`` unless configured otherwise). Its
``schema_version`` table records which numbered files of ``sql/migrations/`` were applied.
Migration runs in one transaction under a transaction-scoped advisory lock, so concurrent
workers queue behind the first one and then find nothing left to do.
"""

from __future__ import annotations

import contextlib
import re
import threading

import psycopg
from psycopg import sql

from airflow_idempotency._sql import latest_migration, migrations
from airflow_idempotency.exceptions import InvalidInputError, SchemaError, SchemaNotReadyError
from airflow_idempotency.locks import migration_lock_key, pooler_refusal

DEFAULT_SCHEMA = "idempotency"
# The Airflow connection of the bookkeeping database (and, by default, of the job).
DEFAULT_CONN_ID = "idempotency_default"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")

_migrated: set[tuple[tuple[bytes | None, ...], str]] = set()
_migrated_guard = threading.Lock()


def latest_version() -> int:
    """The schema version this code expects."""
    return latest_migration()


def validate_schema_name(schema: str) -> str:
    """Return ``schema`` if it is a plain lower-case identifier, else raise."""
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise InvalidInputError(
            f"invalid schema name {schema!r}: use lower-case letters, digits and underscores "
            "(at most 63 characters, not starting with a digit), for example 'idempotency'"
        )
    return schema


def current_version(conn: psycopg.Connection, schema: str) -> int:
    """The applied schema version, 0 when the schema or its version table does not exist.

    One round trip in the usual case (the table exists, autocommit): a missing table is
    learnt from the failed statement, which a connection without autocommit runs in a
    transaction (or savepoint) of its own so that the error leaves nothing aborted.
    """
    stmt = sql.SQL("SELECT coalesce(max(version), 0) FROM {}.schema_version").format(
        sql.Identifier(schema)
    )
    probe = contextlib.nullcontext() if conn.autocommit else conn.transaction()
    try:
        with probe:
            found = conn.execute(stmt).fetchone()
    except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
        return 0
    return int(found[0]) if found else 0


def require_readable(conn: psycopg.Connection, schema: str) -> int:
    """The applied schema version, if this code can read the tables; never creates or migrates.

    Raises :class:`SchemaNotReadyError` when the schema is missing (no idempotent task ran
    against this database yet, or the reader points elsewhere) or older than this code (a
    task of this version, or ``airflow-idempotency migrate``, brings it up to date). A newer
    schema is read: migrations only add.
    """
    version = current_version(conn, schema)
    expected = latest_version()
    if version >= expected:
        return version
    where = f"schema {schema!r} of database {conn.info.dbname!r}"
    if version == 0:
        message = f"{where} has no bookkeeping tables"
    else:
        message = f"{where} is at version {version}, older than this code (version {expected})"
    raise SchemaNotReadyError(message, version=version, expected=expected)


def _server_identity(conn: psycopg.Connection) -> tuple[bytes | None, ...]:
    """Which server and database ``conn`` talks to, cheaply (libpq's accessors, no parsing)."""
    pgconn = conn.pgconn
    return (pgconn.host, pgconn.port, pgconn.db, pgconn.user)


def ensure_schema(conn: psycopg.Connection, schema: str = DEFAULT_SCHEMA) -> int:
    """Create or migrate the tables in ``schema``; return the version now in place.

    ``conn`` must not be inside a transaction. Cheap after the first call per process.
    """
    validate_schema_name(schema)
    cache_key = (_server_identity(conn), schema)
    if cache_key in _migrated:
        return latest_version()
    target = latest_version()
    if current_version(conn, schema) == target:
        with _migrated_guard:
            _migrated.add(cache_key)
        return target
    try:
        _migrate(conn, schema, target)
    except psycopg.Error as exc:
        refusal = pooler_refusal(exc)
        if refusal is None:
            raise
        raise refusal from exc
    with _migrated_guard:
        _migrated.add(cache_key)
    return target


def _migrate(conn: psycopg.Connection, schema: str, target: int) -> None:
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%(key)s)", {"key": migration_lock_key(schema)})
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.schema_version ("
                " version integer PRIMARY KEY,"
                " name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(sql.Identifier(schema))
        )
        applied = current_version(conn, schema)
        if applied > target:
            raise SchemaError(
                f"schema {schema!r} is at version {applied}, newer than this release "
                f"(version {target}): upgrade airflow-provider-idempotency on this worker"
            )
        conn.execute(
            "SELECT set_config('search_path', quote_ident(%(schema)s), true)", {"schema": schema}
        )
        for version, name, body in migrations():
            if version <= applied:
                continue
            conn.execute(body.encode())  # a file of plain DDL, shipped with the package
            conn.execute(
                "INSERT INTO schema_version (version, name) VALUES (%(version)s, %(name)s)",
                {"version": version, "name": name},
            )
