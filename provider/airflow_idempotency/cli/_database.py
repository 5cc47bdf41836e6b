"""The job database of a command: its connection string and the connections it opens.

Its connection string comes from ``--dsn``, else ``AIRFLOW_IDEMPOTENCY_DSN``, else the Airflow
connection ``--conn-id`` (the only case that imports Airflow).

Connection strings are built by psycopg (:func:`psycopg.conninfo.make_conninfo`), which quotes
every value: a password with a space or a quote works, and no message repeats it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from airflow_idempotency.cli._arguments import check_dsn
from airflow_idempotency.cli._base import DSN_ENV, EXIT_UNAVAILABLE, EXIT_USAGE, CommandError
from airflow_idempotency.connection import CONNECT_TIMEOUT
from airflow_idempotency.exceptions import MissingPrivilegeError, SchemaNotReadyError
from airflow_idempotency.run_context import iso_datestyle
from airflow_idempotency.schema import ensure_schema, require_readable


def dsn(args: argparse.Namespace) -> str:
    """The connection string of the job database (see the module's docstring)."""
    if args.dsn:
        return str(args.dsn)
    from_env = os.environ.get(DSN_ENV)
    if from_env:
        try:
            check_dsn(from_env, f"${DSN_ENV}")
        except argparse.ArgumentTypeError as exc:
            raise CommandError(str(exc), EXIT_USAGE) from None
        return from_env
    return airflow_dsn(args.conn_id)


def airflow_dsn(conn_id: str) -> str:
    """The connection string of the Airflow connection ``conn_id``, as the provider's tasks
    connect (the hook's arguments, an IAM token included), quoted by psycopg."""
    from airflow_idempotency.cli._output import logs_to_stderr
    from airflow_idempotency.hook import IdempotencyHook

    logs_to_stderr()  # Airflow 2 logs to stdout, where --json output goes
    kwargs: dict[str, Any] = {}
    try:
        kwargs = IdempotencyHook(postgres_conn_id=conn_id).connection_kwargs()
        return make_conninfo("", **{k: v for k, v in kwargs.items() if v is not None})
    except Exception as exc:  # Airflow's "not defined", a bad extra, a missing provider
        raise CommandError(
            f"cannot read Airflow connection {conn_id!r} ({type(exc).__name__}: "
            f"{redact(str(exc), kwargs)}). Pass --dsn, set "
            f"{DSN_ENV}, or name another connection with --conn-id.",
            EXIT_UNAVAILABLE,
        ) from exc


def redact(message: str, params: str | dict[str, Any]) -> str:
    """``message`` with the passwords of the connection ``params`` (a connection string or
    psycopg's keyword arguments) masked: libpq quotes parts of a connection string in its
    errors, and the server names the database, which may be a whole connection string pasted
    there (with a password of its own)."""
    for password in sorted(_passwords(params), key=len, reverse=True):
        message = message.replace(password, "***")
    return message


_CONNINFO_PREFIXES = ("postgresql://", "postgres://")


def _passwords(params: str | dict[str, Any], depth: int = 0) -> set[str]:
    """The passwords of ``params``, and of any of its values that is a connection string."""
    try:
        values = conninfo_to_dict(params) if isinstance(params, str) else params
    except psycopg.Error:
        return set()
    found = {str(values["password"])} if values.get("password") else set()
    for value in values.values():
        text = str(value)
        if depth < 2 and ("=" in text or text.startswith(_CONNINFO_PREFIXES)):
            found |= _passwords(text, depth + 1)
    return found


def connect(args: argparse.Namespace) -> psycopg.Connection:
    """A connection to the job database (no server-side prepared statements: see locks.py);
    exit 69 naming the database when it cannot be reached."""
    conninfo = dsn(args)
    if "connect_timeout" not in conninfo_to_dict(conninfo):  # a wait with a bound
        conninfo = make_conninfo(conninfo, connect_timeout=CONNECT_TIMEOUT)
    try:
        conn = psycopg.connect(conninfo, autocommit=True, prepare_threshold=None)
    except psycopg.Error as exc:
        raise CommandError(
            f"cannot reach the job database: {redact(str(exc).strip(), conninfo)}",
            EXIT_UNAVAILABLE,
        ) from exc
    iso_datestyle(conn)  # the records' times are read whatever the database's DateStyle
    return conn


def connect_read(args: argparse.Namespace) -> psycopg.Connection:
    """A connection for reading the bookkeeping tables, which must exist: no DDL, ever."""
    conn = connect(args)
    database = conn.info.dbname
    try:
        require_readable(conn, args.schema)
    except SchemaNotReadyError as exc:
        conn.close()
        if exc.version == 0:
            raise CommandError(
                f"database {database!r} has no bookkeeping tables in schema {args.schema!r}: "
                "no idempotent task has run against it yet, or --dsn / --conn-id / --schema "
                "point elsewhere (`airflow-idempotency migrate` creates them).",
                EXIT_UNAVAILABLE,
            ) from exc
        raise CommandError(
            f"schema {args.schema!r} of database {database!r} is at version {exc.version}, "
            f"older than this CLI (version {exc.expected}): run `airflow-idempotency "
            "migrate`, or let a task of this version run first.",
            EXIT_UNAVAILABLE,
        ) from exc
    except psycopg.errors.InsufficientPrivilege as exc:
        conn.close()
        raise CommandError(
            f"the role may not read schema {args.schema!r} of database {database!r} "
            f"({str(exc).strip().splitlines()[0]}): grant it USAGE on the schema and SELECT "
            "on its tables (docs/connection.md, privileges).",
            EXIT_UNAVAILABLE,
        ) from exc
    return conn


def connect_write(args: argparse.Namespace) -> psycopg.Connection:
    """A connection for commands that write: creates or migrates the schema when needed;
    exit 69 with the statements a DBA runs when the role may not."""
    conn = connect(args)
    try:
        ensure_schema(conn, args.schema)
    except MissingPrivilegeError as exc:
        conn.close()
        raise CommandError(str(exc), EXIT_UNAVAILABLE) from exc
    return conn
