"""``gaps``: the periods of a job, in a range, that have no completed run."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from airflow_idempotency.cli._base import EXIT_FAILED, EXIT_OK, add_command, connect_read
from airflow_idempotency.cli._output import emit

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands, common, "gaps", "periods of a job with no completed run (exit 1 if any)", handle
    )
    parser.add_argument("job")
    parser.add_argument("--from", dest="from_key", required=True, metavar="RUN_KEY")
    parser.add_argument("--to", dest="to_key", required=True, metavar="RUN_KEY")


def handle(args: argparse.Namespace) -> int:
    """The periods of a job in a range with no completed run; exit 1 when there are any."""
    from airflow_idempotency import status

    with connect_read(args) as conn:
        found = status.gaps(conn, args.schema, args.job, args.from_key, args.to_key)
    rows = [gap.as_dict() for gap in found]
    emit(
        args,
        f"{args.job}: periods without a completed run, {args.from_key} .. {args.to_key}",
        rows,
        ["run_key", "state", "attempts", "updated_at", "last_error"],
    )
    return EXIT_FAILED if found else EXIT_OK
