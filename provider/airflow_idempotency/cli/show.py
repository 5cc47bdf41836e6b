"""``show``: one run and every attempt at it, with where in Airflow each came from."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from airflow_idempotency import records
from airflow_idempotency._sql import query_rows
from airflow_idempotency.cli._arguments import text
from airflow_idempotency.cli._base import EXIT_FAILED, EXIT_OK, add_command
from airflow_idempotency.cli._database import connect_read
from airflow_idempotency.cli._output import emit, print_json, spelling_note

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands

RUN_COLUMNS = [
    "status",
    "triggered_by",
    "triggering_user",
    "dag_id",
    "run_id",
    "attempt_count",
    "started_at",
    "completed_at",
    "details",
]
ATTEMPT_COLUMNS = [
    "attempt_id",
    "outcome",
    "triggered_by",
    "dag_id",
    "task_id",
    "try_number",
    "hostname",
    "pid",
    "started_at",
    "finished_at",
    "error",
]
# Where each attempt came from in Airflow (migration 0011; NULL where the line has no such
# value, and for attempts recorded outside Airflow or before it): a table of its own, so
# the attempts table stays readable.
PROVENANCE_COLUMNS = [
    "attempt_id",
    "run_id",
    "map_index",
    "run_type",
    "triggering_user",
    "clear_number",
    "ti_id",
    "dag_version_id",
]


EXAMPLES = """
show finalize_invoices.export_invoices 2026-10-01
show finalize_invoices.export_invoices eu|2026-10-01 --json
"""


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "show", "one run and all its attempts", handle, EXAMPLES)
    parser.add_argument("job", type=text, help="the job name, e.g. finalize_invoices.export")
    parser.add_argument("run_key", type=text, help="the run key, e.g. 2026-10-01")


def handle(args: argparse.Namespace) -> int:
    """The job_runs row of one (job, run key) and all its attempts; exit 1 if none."""
    with connect_read(args) as conn:
        run = records.get_run(conn, args.schema, args.job, args.run_key)
        attempts = query_rows(
            conn, "cli_attempts", args.schema, {"job": args.job, "run_key": args.run_key}
        )
    if run is None and not attempts:
        note = spelling_note(args.run_key)
        said = f"no run recorded for job {args.job!r} run_key {args.run_key!r}{note}"
        print(said, file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print_json({"run": run.__dict__ if run else None, "attempts": attempts})
        return EXIT_OK
    if run:
        emit(args, f"{args.job} {args.run_key}", [run.__dict__], RUN_COLUMNS)
    emit(args, "attempts", attempts, ATTEMPT_COLUMNS)
    airflow = [a for a in attempts if a["dag_id"] is not None]
    if airflow:
        emit(args, "Airflow provenance of the attempts", airflow, PROVENANCE_COLUMNS)
    return EXIT_OK
