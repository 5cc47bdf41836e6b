"""``plan``: which business dates a backfill of a range would cover, and what each would do."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from airflow_idempotency.cli import _dags
from airflow_idempotency.cli._arguments import instant, text
from airflow_idempotency.cli._base import EXIT_OK, EXIT_USAGE, CommandError, add_command, add_range
from airflow_idempotency.cli._database import connect
from airflow_idempotency.cli._output import emit
from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.schema import current_version

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


EXAMPLES = """
plan finalize_invoices --from 2026-10-01 --to 2026-10-31
plan finalize_invoices --from 2026-10-01 --to 2026-10-07 --command dags-backfill --json
"""


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands,
        common,
        "plan",
        "what a backfill of a range would run, date by date",
        handle,
        EXAMPLES,
    )
    parser.add_argument("dag_id", type=text, help="the DAG's id")
    add_range(
        parser,
        "date",
        instant,
        "DATE",
        "the backfill's start, ISO date or date-time (naive: UTC), as the backfill "
        "command takes it",
        "the backfill's end, ISO date or date-time, not before --from",
    )
    parser.add_argument(
        "--command",
        dest="command_name",
        choices=["dags-backfill", "backfill-create"],
        default=None,
        help="the backfill command (default: this Airflow line's; the other line's "
        "answers for that line's timetable of a cron string)",
    )
    _dags.add_dags_folder(parser)


def handle(args: argparse.Namespace) -> int:
    """Which business dates a backfill would cover on this Airflow line, and what each does."""
    from airflow_idempotency import compat, partitions, planning

    command = args.command_name or compat.BACKFILL_COMMAND
    if args.to_date < args.from_date:
        raise CommandError(f"--from {args.from_date} is after --to {args.to_date}", EXIT_USAGE)
    dag = _dags.load_dag(args)
    with connect(args) as conn:
        recorded = conn if current_version(conn, args.schema) else None  # else: all new
        with _dags.airflow_quiet():
            try:
                rows = planning.plan(
                    dag, recorded, args.schema, args.from_date, args.to_date, command
                )
            except InvalidInputError as exc:
                raise CommandError(str(exc), EXIT_USAGE) from exc
    # A partition is named by its key and, where Airflow gives it, its exact instant: the
    # two 02:00 hours of an autumn night share a key but are two runs with two run keys.
    when = (
        ["partition_key", "partition_date"]
        if partitions.dag_partitioning(dag)[0]
        else ["logical_date"]
    )
    emit(
        args,
        f"{args.dag_id}: {command} {args.from_date.isoformat()} .. {args.to_date.isoformat()}",
        rows,
        [*when, "task_id", "run_key", "status", "would", "explanation"]
        if args.json
        else [*when, "task_id", "run_key", "status", "would"],
    )
    return EXIT_OK
