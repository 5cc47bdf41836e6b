"""``runs``: the job runs, filtered; ``runs --stale``: abandoned work nobody holds."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from airflow_idempotency._sql import query_rows
from airflow_idempotency.cli._arguments import count, text
from airflow_idempotency.cli._base import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    add_command,
)
from airflow_idempotency.cli._database import connect_read
from airflow_idempotency.cli._output import age, emit

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


EXAMPLES = """
runs --job finalize_invoices.export_invoices --status failed
runs --from 2026-10-01 --to 2026-10-31 --json
runs --stale   # exit 1 when abandoned work is found
"""
MAX_LIMIT = 100_000


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "runs", "list job runs", handle, EXAMPLES)
    parser.add_argument("--job", type=text, help="only this job, e.g. finalize_invoices.export")
    parser.add_argument(
        "--status", choices=["started", "completed", "failed"], help="only runs in this status"
    )
    parser.add_argument(
        "--from", dest="from_key", type=text, metavar="RUN_KEY", help="run keys >= this"
    )
    parser.add_argument(
        "--to", dest="to_key", type=text, metavar="RUN_KEY", help="run keys <= this"
    )
    parser.add_argument(
        "--limit",
        type=count(MAX_LIMIT),
        default=100,
        metavar="N",
        help=f"at most N runs, newest key first (default: 100; 1 to {MAX_LIMIT})",
    )
    parser.add_argument(
        "--stale",
        action="store_true",
        help="only attempts still running and keys still started whose lock nobody holds "
        "(exit 1 when there are any)",
    )


def handle(args: argparse.Namespace) -> int:
    """The job runs, newest key first, filtered by job, status and a range of run keys."""
    if args.from_key and args.to_key and args.from_key > args.to_key:
        raise CommandError(
            f"--from {args.from_key} is after --to {args.to_key}: nothing could match; swap them",
            EXIT_USAGE,
        )
    if args.stale:
        ignored = [o for o, v in (("--status", args.status), ("--from", args.from_key),
                                  ("--to", args.to_key)) if v]  # fmt: skip
        if ignored:
            raise CommandError(
                f"--stale lists abandoned work of every status and key (only --job narrows "
                f"it): drop {', '.join(ignored)}",
                EXIT_USAGE,
            )
        return stale(args)
    with connect_read(args) as conn:
        rows = query_rows(
            conn,
            "cli_list_runs",
            args.schema,
            {
                "job": args.job,
                "status": args.status,
                "from_key": args.from_key,
                "to_key": args.to_key,
                "limit": args.limit,
            },
        )
    emit(
        args,
        "job_runs",
        rows,
        [
            "job_name",
            "run_key",
            "status",
            "triggered_by",
            "attempt_count",
            "started_at",
            "completed_at",
            "details",
        ],
    )
    return EXIT_OK


def stale(args: argparse.Namespace) -> int:
    """Attempts still running and keys still started whose lock nobody holds; exit 1 if any."""
    from airflow_idempotency import gaps

    with connect_read(args) as conn:
        rows = gaps.stale(conn, args.schema, args.job)
    for row in rows:
        row["age"] = age(row["age"])
    emit(
        args,
        "stale: running or started, nobody holds the lock",
        rows,
        [
            "job_name",
            "run_key",
            "status",
            "attempt_id",
            "hostname",
            "pid",
            "started_at",
            "age",
            "lock",
        ],
    )
    return EXIT_FAILED if rows else EXIT_OK
