"""``migrate``: create or migrate the bookkeeping schema."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

import psycopg

from airflow_idempotency.cli._base import (
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    CommandError,
    add_command,
)
from airflow_idempotency.cli._database import connect
from airflow_idempotency.exceptions import MigrationBlockedError
from airflow_idempotency.schema import (
    MIGRATION_BOUNDS,
    current_version,
    ensure_schema,
    missing_privileges,
    privilege_refusal,
)

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


def seconds(value: str) -> float:
    """argparse type: a number of seconds from 0 to a day."""
    try:
        number = float(value) if value.isascii() else None
    except ValueError:
        number = None
    if number is None or not 0 <= number <= 86_400:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds from 0 to 86400")
    return number


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands,
        common,
        "migrate",
        "create or migrate the bookkeeping schema",
        handle,
        'migrate --dsn "host=db dbname=jobs user=jobs_owner"\nmigrate --schema idempotency_eu\n'
        "migrate --wait 300",
    )
    parser.add_argument(
        "--wait",
        type=seconds,
        default=MIGRATION_BOUNDS.give_up_after,
        metavar="SECONDS",
        help="give up after this long when other sessions hold the tables' locks (each try "
        f"waits at most {MIGRATION_BOUNDS.lock_timeout:g} s, then lets their statements go); "
        f"default {MIGRATION_BOUNDS.give_up_after:g}",
    )


def handle(args: argparse.Namespace) -> int:
    """Create or migrate the bookkeeping schema (what the first task of a version does).

    Run it once per upgrade, before the upgraded workers start (docs/deploying.md, upgrading).
    Exits 75 when other sessions held the tables' locks for longer than --wait (nothing was
    changed; the message names them).
    """
    bounds = dataclasses.replace(MIGRATION_BOUNDS, give_up_after=args.wait)
    with connect(args) as conn:
        try:
            before = current_version(conn, args.schema)
        except psycopg.errors.InsufficientPrivilege as exc:  # a DBA's schema, nothing granted
            missing = missing_privileges(conn, args.schema)
            refusal = privilege_refusal(exc, conn, args.schema, migrating=False, missing=missing)
            raise CommandError(str(refusal), EXIT_UNAVAILABLE) from exc
        try:
            after = ensure_schema(conn, args.schema, bounds=bounds)
        except MigrationBlockedError as exc:
            raise CommandError(str(exc), EXIT_LOCKED) from exc
    print(f"schema {args.schema!r}: version {before} -> {after}")
    return EXIT_OK
