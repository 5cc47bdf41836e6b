"""Create and migrate the bookkeeping tables, safely when many workers start at once.

The tables live in one schema (``idempotency`` unless configured otherwise). Its
``schema_version`` table records which files of ``sql/migrations/`` were applied (number,
name, checksum). Migration runs in one transaction under a transaction-scoped advisory lock,
so concurrent workers queue behind the first one and then find nothing left to do; every
wait of it is bounded and every file identified (:mod:`airflow_idempotency.migrator`).
"""

from __future__ import annotations

import contextlib
import re
import threading

import psycopg
from psycopg import sql

from airflow_idempotency._sql import migrations, query_rows
from airflow_idempotency.exceptions import (
    InvalidInputError,
    MissingPrivilegeError,
    SchemaNotReadyError,
)
from airflow_idempotency.locks import pooler_refusal
from airflow_idempotency.migrator import MigrationBounds, applied_migrations, migrate, plan

DEFAULT_SCHEMA = "idempotency"
# The Airflow connection of the bookkeeping database (and, by default, of the job).
DEFAULT_CONN_ID = "idempotency_default"
MIGRATION_BOUNDS = MigrationBounds()
"""The bounds of a migration a task or a command starts: each lock wait 2 s, all tries 60 s,
a silent client's transaction 10 s (:class:`~airflow_idempotency.migrator.MigrationBounds`)."""
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")

_migrated: set[tuple[tuple[bytes | None, ...], str]] = set()
_migrated_guard = threading.Lock()


def latest_version() -> int:
    """The schema version this code expects (the number of its newest migration)."""
    return migrations()[-1].version


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


def ensure_schema(
    conn: psycopg.Connection,
    schema: str = DEFAULT_SCHEMA,
    *,
    bounds: MigrationBounds | None = None,
) -> int:
    """Create or migrate the tables in ``schema``; return the version now in place.

    ``conn`` must not be inside a transaction. Cheap after the first call per process: one
    statement reads the record of applied migrations and compares it with this release's
    files. Raises :class:`SchemaTooNewError` (a newer release migrated the database),
    :class:`MigrationMismatchError` (an applied file differs from this release's) and, when a
    migration waited longer than ``bounds`` (default :data:`MIGRATION_BOUNDS`) for another
    session's lock, :class:`MigrationBlockedError` naming it; see :mod:`.migrator`.
    """
    validate_schema_name(schema)
    cache_key = (_server_identity(conn), schema)
    if cache_key in _migrated:
        return latest_version()
    where = f"schema {schema!r} of database {conn.info.dbname!r}"
    try:
        applied = applied_migrations(conn, schema)
    except psycopg.errors.InsufficientPrivilege as exc:
        try:  # the probe ran alone (autocommit, or a savepoint): the session is usable
            missing = missing_privileges(conn, schema)
        except psycopg.Error:
            missing = []
        raise privilege_refusal(exc, conn, schema, migrating=False, missing=missing) from exc
    shipped = migrations()
    todo = plan(applied, shipped, where)
    if todo.pending or todo.adopt:
        try:
            migrate(conn, schema, where, bounds or MIGRATION_BOUNDS, shipped)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise privilege_refusal(exc, conn, schema, migrating=True) from exc
        except psycopg.Error as exc:
            refusal = pooler_refusal(exc)
            if refusal is None:
                raise
            raise refusal from exc
    with _migrated_guard:
        _migrated.add(cache_key)
    return shipped[-1].version


def _quoted(name: str) -> str:
    """``name`` as a SQL identifier in a message a DBA copies (the statements are theirs)."""
    return '"' + name.replace('"', '""') + '"'


def privilege_refusal(
    exc: psycopg.Error,
    conn: psycopg.Connection,
    schema: str,
    *,
    migrating: bool,
    missing: list[str] | None = None,
) -> MissingPrivilegeError:
    """The error to raise when PostgreSQL refused the provider's own statement on the job
    database for a missing privilege (``exc``, SQLSTATE 42501): what the role lacks, and both
    ways out, with the statements to run. ``migrating``: the refused statement created or
    migrated the tables (else it used them); ``missing``: what the role lacks to use them
    (:func:`missing_privileges`), named in the message. The one place this message is
    written: the runner, :func:`ensure_schema` and ``airflow-idempotency migrate`` raise it.
    """
    role, database = conn.info.user, conn.info.dbname
    said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    where = f"schema {schema!r} of database {database!r}"
    grant_use = (
        f"GRANT USAGE ON SCHEMA {_quoted(schema)} TO {_quoted(role)}; GRANT SELECT, INSERT, "
        f"UPDATE, DELETE ON ALL TABLES IN SCHEMA {_quoted(schema)} TO {_quoted(role)};"
    )
    migrate = f"airflow-idempotency migrate --dsn DBA_DSN --schema {schema}"
    if migrating:
        return MissingPrivilegeError(
            f"role {role!r} may not create or migrate the bookkeeping tables in {where} "
            f"(PostgreSQL said: {said}). Nothing was written, and a retry would be refused "
            f"the same way. Either let the role create them: GRANT CREATE ON DATABASE "
            f"{_quoted(database)} TO {_quoted(role)}; (or create the schema for it: CREATE "
            f"SCHEMA {_quoted(schema)} AUTHORIZATION {_quoted(role)};), or have a DBA create "
            f"them with a role that may, `{migrate}` (DBA_DSN: a connection string of that "
            f"role; after each provider upgrade too), then grant this role their use: "
            f"{grant_use} See docs/connection.md, privileges."
        )
    lacks = f" It lacks {', '.join(missing)}." if missing else ""
    return MissingPrivilegeError(
        f"role {role!r} may not use the bookkeeping tables in {where} (PostgreSQL said: "
        f"{said}).{lacks} Nothing was written, and a retry would be refused the same way. Either "
        f"grant the role their use: {grant_use} or have a DBA run `{migrate}` with a role "
        f"that owns them and grant this role their use then. See docs/connection.md, "
        f"privileges."
    )


def missing_privileges(conn: psycopg.Connection, schema: str) -> list[str]:
    """What the role of ``conn`` lacks to use the bookkeeping tables of ``schema``
    (``USAGE on schema x``, ``INSERT on table y``, ...); empty when nothing is missing or the
    schema does not exist."""
    rows = query_rows(conn, "missing_privileges", schema, {"schema": schema})
    return [str(row["missing"]) for row in rows]
