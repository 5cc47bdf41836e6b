"""What every command shares: exit codes, the common options, argument types and the job
database connections. Nothing here imports Airflow unless ``--conn-id`` needs it."""

from __future__ import annotations

import argparse
import datetime as dt
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from airflow_idempotency.connection import CONNECT_TIMEOUT
from airflow_idempotency.exceptions import SchemaNotReadyError
from airflow_idempotency.schema import DEFAULT_SCHEMA, ensure_schema, require_readable

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_LOCKED = 0, 1, 2, 75
DSN_ENV = "AIRFLOW_IDEMPOTENCY_DSN"

Handler = Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A command cannot go on: its message is printed, the process exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def common_options() -> argparse.ArgumentParser:
    """The options of every command (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsn", help=f"libpq DSN of the job database (or set {DSN_ENV})")
    common.add_argument("--conn-id", default="idempotency_default", help="Airflow connection id")
    common.add_argument("--schema", default=DEFAULT_SCHEMA, help="bookkeeping schema")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    return common


def add_command(
    commands: Subcommands,
    common: argparse.ArgumentParser,
    name: str,
    help: str,
    handler: Handler,
) -> argparse.ArgumentParser:
    """Add the command ``name`` run by ``handler`` (whose docstring describes it); its
    module then adds the command's own options to the parser returned."""
    parser = commands.add_parser(
        name, parents=[common], help=help, description=(handler.__doc__ or help).strip()
    )
    parser.set_defaults(func=handler)
    return parser


# -- argument types ---------------------------------------------------------------------


def business_date(value: str) -> str:
    """argparse type: a real calendar date written YYYY-MM-DD."""
    try:
        if len(value) == 10:
            return dt.date.fromisoformat(value).isoformat()
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{value!r} is not a date in the format YYYY-MM-DD")


def instant(value: str) -> dt.datetime:
    """argparse type: an ISO date or date-time; a bare date is midnight, a naive time UTC."""
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a date or date-time, e.g. 2026-10-02 or 2026-10-02T01:00:00+00:00"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


# -- the job database ---------------------------------------------------------------------


def dsn(args: argparse.Namespace) -> str:
    """``--dsn``, else ``AIRFLOW_IDEMPOTENCY_DSN``, else the Airflow connection ``--conn-id``
    (the only case that imports Airflow)."""
    if args.dsn or os.environ.get(DSN_ENV):
        return str(args.dsn or os.environ[DSN_ENV])
    from airflow_idempotency.cli._output import logs_to_stderr
    from airflow_idempotency.hook import IdempotencyHook

    logs_to_stderr()  # Airflow 2 logs to stdout, where --json output goes
    try:
        hook = IdempotencyHook(postgres_conn_id=args.conn_id)
        conn = hook.new_connection()
    except Exception as exc:
        raise SystemExit(
            f"error: cannot open Airflow connection {args.conn_id!r} ({exc}). "
            f"Pass --dsn or set {DSN_ENV}."
        ) from exc
    with conn:
        return str(conn.info.dsn) + (
            f" password={conn.info.password}" if conn.info.password else ""
        )


def connect(args: argparse.Namespace) -> psycopg.Connection:
    """A connection to the job database (no server-side prepared statements: see locks.py)."""
    conninfo = dsn(args)
    if "connect_timeout" not in conninfo_to_dict(conninfo):
        conninfo = make_conninfo(conninfo, connect_timeout=CONNECT_TIMEOUT)
    return psycopg.connect(conninfo, autocommit=True, prepare_threshold=None)


def connect_read(args: argparse.Namespace) -> psycopg.Connection:
    """A connection for reading the bookkeeping tables, which must exist: no DDL, ever."""
    conn = connect(args)
    try:
        require_readable(conn, args.schema)
    except SchemaNotReadyError as exc:
        conn.close()
        if exc.version == 0:
            raise CommandError(
                f"database {conn.info.dbname!r} has no bookkeeping tables in schema "
                f"{args.schema!r}: no idempotent task has run against it yet, or --dsn / "
                "--conn-id / --schema point elsewhere."
            ) from exc
        raise CommandError(
            f"schema {args.schema!r} is at version {exc.version}, older than this CLI "
            f"(version {exc.expected}): run `airflow-idempotency migrate`, or let a task "
            "of this version run first."
        ) from exc
    return conn


def connect_write(args: argparse.Namespace) -> psycopg.Connection:
    """A connection for commands that write: creates or migrates the schema when needed."""
    conn = connect(args)
    ensure_schema(conn, args.schema)
    return conn
