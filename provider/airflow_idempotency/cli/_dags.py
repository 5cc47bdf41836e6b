"""What the commands that read a DAG share (``run``, ``explain``, ``plan``).

They parse the DAG file through Airflow, imported here only when such a command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from airflow_idempotency.cli._arguments import text
from airflow_idempotency.cli._base import EXIT_USAGE, CommandError
from airflow_idempotency.cli._output import logs_to_stderr

if TYPE_CHECKING:
    from airflow_idempotency.planning import Explained


def add_dags_folder(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dags-folder",
        type=text,
        metavar="PATH",
        help="the folder of DAG files to read the DAG from (default: Airflow's [core] dags_folder)",
    )


@contextlib.contextmanager
def airflow_quiet() -> Iterator[None]:
    """Whatever Airflow logs while it parses DAGs goes to stderr: stdout is our output."""
    logs_to_stderr()
    with contextlib.redirect_stdout(sys.stderr):
        yield


def load_dag(args: argparse.Namespace) -> Any:
    """The DAG ``args.dag_id`` from ``args.dags_folder``; exit 2 naming the DAGs there if absent."""
    from airflow_idempotency import compat

    try:
        with airflow_quiet():
            return compat.load_dag(args.dag_id, args.dags_folder)
    except LookupError as exc:
        raise CommandError(str(exc).strip("'\""), EXIT_USAGE) from exc


def explain(
    args: argparse.Namespace,
    kind: str,
    logical_date: dt.datetime | None,
    conf: Mapping[str, Any],
) -> list[Explained]:
    """The run key each idempotent task of the DAG would get in such a run, or its refusal
    (``InvalidInputError``, exit 2, for a DAG without an idempotent task)."""
    from airflow_idempotency import planning

    dag = load_dag(args)
    with airflow_quiet():
        return planning.explain(
            dag,
            kind=kind,
            logical_date=logical_date,
            conf=conf,
            partition_key=getattr(args, "partition_key", None),
            partition_date=getattr(args, "partition_date", None),
        )
