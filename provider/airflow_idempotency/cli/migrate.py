"""``migrate``: create or migrate the bookkeeping schema."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from airflow_idempotency.cli._base import EXIT_OK, add_command
from airflow_idempotency.cli._database import connect
from airflow_idempotency.schema import current_version, ensure_schema

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    add_command(
        commands,
        common,
        "migrate",
        "create or migrate the bookkeeping schema",
        handle,
        'migrate --dsn "host=db dbname=jobs user=jobs_owner"\nmigrate --schema idempotency_eu',
    )


def handle(args: argparse.Namespace) -> int:
    """Create or migrate the bookkeeping schema (what the first task of a version does)."""
    with connect(args) as conn:
        before = current_version(conn, args.schema)
        after = ensure_schema(conn, args.schema)
    print(f"schema {args.schema!r}: version {before} -> {after}")
    return EXIT_OK
