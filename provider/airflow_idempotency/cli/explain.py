"""``explain``: the run key a run of a DAG would get, and why (or why it would be refused)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from airflow_idempotency.cli import _dags
from airflow_idempotency.cli._arguments import instant, text
from airflow_idempotency.cli._base import EXIT_OK, EXIT_USAGE, CommandError, add_command
from airflow_idempotency.cli._output import emit

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


EXAMPLES = """
explain finalize_invoices --logical-date 2026-10-02T01:00:00+00:00
explain finalize_invoices --conf '{"run_key": "2026-10-01"}'
explain finalize_invoices --run-type backfill --logical-date 2026-10-02
explain partitioned_invoices --partition-key 2026-10-01
explain hourly_meter --partition-key 2026-10-25T02:00:00 --partition-date 2026-10-25T01:00:00Z
"""


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands, common, "explain", "the run key a run would get, and why", handle, EXAMPLES
    )
    parser.add_argument("dag_id", type=text, help="the DAG's id")
    parser.add_argument(
        "--logical-date",
        type=instant,
        help="the run's logical date, ISO date or date-time (naive: UTC), e.g. 2026-10-02T01:00",
    )
    parser.add_argument(
        "--run-type",
        choices=["manual", "scheduled", "backfill"],
        help="the kind of run (default: manual when --conf gives a run_key, else scheduled)",
    )
    parser.add_argument(
        "--conf",
        type=text,
        metavar="JSON",
        help='the run\'s conf, a JSON object, e.g. \'{"run_key": "2026-10-01"}\'',
    )
    parser.add_argument(
        "--partition-key",
        type=text,
        help="the run's partition key (a partitioned DAG, Airflow 3.2+), e.g. 2026-10-01",
    )
    parser.add_argument(
        "--partition-date",
        type=instant,
        help="the partition's exact instant, as `plan` lists it (naive: UTC); it tells apart "
        "the two 02:00 hours of an autumn night, which share one partition key",
    )
    _dags.add_dags_folder(parser)


def handle(args: argparse.Namespace) -> int:
    """The run key each idempotent task of a run would get, and why; exit 2 when refused."""
    try:
        conf = json.loads(args.conf or "{}")
    except json.JSONDecodeError as exc:
        raise CommandError(f"--conf is not JSON: {exc}", EXIT_USAGE) from exc
    if not isinstance(conf, dict):
        raise CommandError(
            '--conf must be a JSON object, e.g. \'{"run_key": "2026-10-01"}\'', EXIT_USAGE
        )
    if args.partition_date is not None and args.partition_key is None:
        raise CommandError(
            "--partition-date names the instant of a partition: give --partition-key too",
            EXIT_USAGE,
        )
    # A conf naming its run key is what a triggered run carries; a scheduled run has none.
    run_type = args.run_type or ("manual" if "run_key" in conf else "scheduled")
    explained = _dags.explain(args, run_type, args.logical_date, conf)
    at = f"partition {args.partition_key}" if args.partition_key else None
    if at and args.partition_date is not None:
        at += f" ({args.partition_date.isoformat()})"
    emit(
        args,
        f"{args.dag_id}: {run_type} run at {at or args.logical_date or 'no logical date'}",
        [e.as_dict() for e in explained],
        ["task_id", "job_name", "run_key", "explanation"],
    )
    return EXIT_USAGE if any(e.run_key is None for e in explained) else EXIT_OK
