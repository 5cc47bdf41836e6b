"""``adopt``: record the keys of runs Airflow already records as succeeded.

A plan first; ``--apply`` writes. See :mod:`airflow_idempotency.adoption` and
docs/adopt.md."""

from __future__ import annotations

import argparse
import datetime as dt
import os
from typing import TYPE_CHECKING

from airflow_idempotency.cli import _dags
from airflow_idempotency.cli._arguments import business_date, http_url, text
from airflow_idempotency.cli._base import EXIT_OK, EXIT_USAGE, CommandError, add_command
from airflow_idempotency.cli._database import connect, connect_write
from airflow_idempotency.cli._output import emit
from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.schema import current_version

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands

COLUMNS = ["logical_date", "run_id", "task_id", "run_key", "status", "would"]

EXAMPLES = """
adopt nightly_sales --from 2026-01-01 --to 2026-10-31
adopt nightly_sales --from 2026-01-01 --to 2026-10-31 --apply --api-url http://airflow:8080
"""


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands,
        common,
        "adopt",
        "record the keys of runs that already succeeded",
        handle,
        EXAMPLES,
    )
    parser.add_argument("dag_id", type=text, help="the DAG's id")
    parser.add_argument(
        "--from",
        dest="from_date",
        type=business_date,
        required=True,
        metavar="DATE",
        help="the first logical date (YYYY-MM-DD, from 00:00 UTC)",
    )
    parser.add_argument(
        "--to",
        dest="to_date",
        type=business_date,
        required=True,
        metavar="DATE",
        help="the last logical date (YYYY-MM-DD, to 24:00 UTC), not before --from",
    )
    parser.add_argument("--apply", action="store_true", help="write (default: the plan only)")
    parser.add_argument(
        "--api-url",
        type=http_url,
        default=None,
        help="Airflow 3's api-server (default: $AIRFLOW_IDEMPOTENCY_API_URL, else "
        "http://localhost:8080); Airflow 2 reads its metadata database instead",
    )
    _dags.add_dags_folder(parser)


def handle(args: argparse.Namespace) -> int:
    """Which keys of the DAG's protected tasks come from runs Airflow records as succeeded
    (logical dates from --from to --to, whole UTC days), and whether each would be adopted:
    recorded as completed, ``triggered_by`` adopted, naming the run. Keys with a record
    already are left alone. Nothing is written without --apply."""
    from airflow_idempotency import adoption

    if args.to_date < args.from_date:
        raise CommandError(f"--from {args.from_date} is after --to {args.to_date}", EXIT_USAGE)
    if args.to_date == dt.date.max.isoformat():  # its day ends past Python's last date
        raise CommandError(
            f"--to {args.to_date} is the last day a date can hold, whose end cannot be "
            "written: give a day before it (no DAG runs that late)",
            EXIT_USAGE,
        )
    first = dt.datetime.fromisoformat(args.from_date).replace(tzinfo=dt.timezone.utc)
    last = dt.datetime.fromisoformat(args.to_date).replace(tzinfo=dt.timezone.utc)
    dag = _dags.load_dag(args)
    try:
        adoption.protected_tasks(dag)  # refused before anything is read or written
        with connect_write(args) if args.apply else connect(args) as conn:
            runs = _succeeded(args, first, last + dt.timedelta(days=1))
            recorded = conn if args.apply or current_version(conn, args.schema) else None
            with _dags.airflow_quiet():
                rows = adoption.plan(dag, runs, recorded, args.schema)
            if args.apply:
                adoption.apply(conn, args.schema, args.dag_id, rows)
    except InvalidInputError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from exc
    verb = "adopted" if args.apply else "plan (nothing written; --apply writes)"
    emit(
        args,
        f"{args.dag_id}: {len(runs)} succeeded run(s) {args.from_date} .. {args.to_date}, {verb}",
        [r.as_dict() for r in rows],
        [*COLUMNS, "job_name", "reason"] if args.json else COLUMNS,
    )
    return EXIT_OK


def _succeeded(args: argparse.Namespace, first: dt.datetime, last: dt.datetime) -> list:  # type: ignore[type-arg]
    from airflow_idempotency import adoption
    from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS

    if not AIRFLOW_V_3_0_PLUS:
        with _dags.airflow_quiet():
            return adoption.metadata_runs(args.dag_id, first, last)
    from_env = os.environ.get(adoption.API_URL_ENV)
    if not args.api_url and from_env:
        try:
            http_url(from_env)
        except argparse.ArgumentTypeError as exc:
            raise CommandError(f"${adoption.API_URL_ENV}: {exc}", EXIT_USAGE) from None
    url = args.api_url or from_env or "http://localhost:8080"
    return adoption.ApiRuns(url).succeeded(args.dag_id, first, last)
