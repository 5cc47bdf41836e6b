"""``explain``: the run key a run of a DAG would get, and why (or why it would be refused)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from airflow_idempotency.cli import _dags
from airflow_idempotency.cli._base import EXIT_OK, EXIT_USAGE, CommandError, add_command, instant
from airflow_idempotency.cli._output import emit

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands, common, "explain", "the run key a run would get, and why", handle
    )
    parser.add_argument("dag_id")
    parser.add_argument("--logical-date", type=instant, help="ISO date or date-time")
    parser.add_argument(
        "--run-type", choices=["manual", "scheduled", "backfill"], default="scheduled"
    )
    parser.add_argument("--conf", help="the run's conf, JSON")
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
    explained = _dags.explain(args, args.run_type, args.logical_date, conf)
    emit(
        args,
        f"{args.dag_id}: {args.run_type} run at {args.logical_date or 'no logical date'}",
        [e.as_dict() for e in explained],
        ["task_id", "job_name", "run_key", "explanation"],
    )
    return EXIT_USAGE if any(e.run_key is None for e in explained) else EXIT_OK
