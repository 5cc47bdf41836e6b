"""``prune``: delete old attempt rows of completed keys (retention)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from airflow_idempotency.cli._base import EXIT_OK, add_command, connect_read

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands, common, "prune", "delete old attempt rows of completed keys", handle
    )
    parser.add_argument(
        "--attempts-older-than", dest="older_than", required=True, metavar="AGE", help="e.g. 400d"
    )
    parser.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    parser.add_argument("--batch-size", type=int, default=10_000)


def handle(args: argparse.Namespace) -> int:
    """Delete old attempt rows of completed keys (never a job_runs row, never the ledger)."""
    from airflow_idempotency import retention

    older_than = retention.parse_age(args.older_than)
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
