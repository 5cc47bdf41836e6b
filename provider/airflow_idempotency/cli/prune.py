"""``prune``: delete old attempt rows of completed keys (retention)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from airflow_idempotency.cli._arguments import age_in_days, count
from airflow_idempotency.cli._base import EXIT_OK, add_command
from airflow_idempotency.cli._database import connect_read

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


MAX_BATCH = 1_000_000


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands,
        common,
        "prune",
        "delete old attempt rows of completed keys",
        handle,
        "prune --attempts-older-than 400d --dry-run\nprune --attempts-older-than 400d",
    )
    parser.add_argument(
        "--attempts-older-than",
        dest="older_than",
        type=age_in_days,
        required=True,
        metavar="AGE",
        help="delete attempts older than this many days, e.g. 400d (1d to 36500d)",
    )
    parser.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    parser.add_argument(
        "--batch-size",
        type=count(MAX_BATCH),
        default=10_000,
        metavar="N",
        help=f"rows deleted per transaction (default: 10000; 1 to {MAX_BATCH})",
    )


def handle(args: argparse.Namespace) -> int:
    """Delete old attempt rows of completed keys (never a job_runs row, never the ledger)."""
    from airflow_idempotency import retention

    older_than = args.older_than
    with connect_read(args) as conn:
        count = retention.prune_attempts(
            conn, args.schema, older_than, dry_run=args.dry_run, batch_size=args.batch_size
        )
    verb = "would delete" if args.dry_run else "deleted"
    summary = {"dry_run": args.dry_run, "older_than_days": older_than.days, "attempts": count}
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{verb} {count} attempt row(s) older than {older_than.days} days, of completed keys "
            "(job_runs rows, the attempt that completed each key and the ledger are kept)"
        )
    return EXIT_OK
