"""``gaps``: the periods of a job, in a range, that have no completed run."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from airflow_idempotency.cli import _dags
from airflow_idempotency.cli._arguments import text
from airflow_idempotency.cli._base import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    add_command,
    add_range,
)
from airflow_idempotency.cli._database import connect_read
from airflow_idempotency.cli._output import emit

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


EXAMPLES = """
gaps finalize_invoices.export_invoices --from 2026-10-01 --to 2026-10-31
gaps finalize_invoices.export_invoices --from 2026-10-01 --to 2026-10-31 --segment eu
gaps weekday_job.work --from 2026-10-01 --to 2026-10-31 --dag weekday_job
"""


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands,
        common,
        "gaps",
        "periods of a job with no completed run (exit 1 if any)",
        handle,
        EXAMPLES,
    )
    parser.add_argument("job", type=text, help="the job name")
    add_range(
        parser,
        "key",
        text,
        "RUN_KEY",
        "the first period, e.g. 2026-10-01, 2026-W40 or 2026-10",
        "the last period, of the same kind as --from",
    )
    parser.add_argument(
        "--segment",
        type=text,
        help="one segment of a segmented job (``eu``, or ``eu|*`` / ``*|eu``: where the period "
        "goes); "
        "default: every segment the job has keys of",
    )
    parser.add_argument(
        "--dag",
        dest="dag_id",
        type=text,
        help="follow this DAG's schedule: only the keys its runs made due are gaps "
        "(a weekday-only job's weekends are not); parses the DAG file through Airflow",
    )
    _dags.add_dags_folder(parser)


def handle(args: argparse.Namespace) -> int:
    """The periods of a job in a range with no completed run; exit 1 when there are any."""
    from airflow_idempotency import gaps

    due = _due_keys(args) if args.dag_id else None
    with connect_read(args) as conn:
        found = gaps.gaps(
            conn, args.schema, args.job, args.from_key, args.to_key, segment=args.segment, due=due
        )
    rows = [gap.as_dict() for gap in found]
    emit(
        args,
        f"{args.job}: periods without a completed run, {args.from_key} .. {args.to_key}",
        rows,
        ["run_key", "state", "attempts", "updated_at", "last_error"],
    )
    return EXIT_FAILED if found else EXIT_OK


def _due_keys(args: argparse.Namespace) -> set[str]:
    """The keys of ``args.job`` that the schedule of DAG ``args.dag_id`` has made due up to
    now, from the day before ``--from``'s period (its run fires after it). Imports Airflow."""
    import datetime as dt

    from airflow_idempotency import planning
    from airflow_idempotency.run_key import RunKeyRule, key_parts

    dag = _dags.load_dag(args)
    period = key_parts(args.from_key).period or args.from_key
    start, _ = RunKeyRule.for_key(period).period_bounds(period, "UTC")
    with _dags.airflow_quiet():
        due = planning.due_keys(dag, start.subtract(days=1), dt.datetime.now(dt.timezone.utc))
    if args.job not in due:
        raise CommandError(
            f"DAG {args.dag_id!r} has no idempotent task of job {args.job!r} "
            f"(its jobs: {', '.join(sorted(due)) or 'none'})",
            EXIT_USAGE,
        )
    return due[args.job]
