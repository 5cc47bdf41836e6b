"""``ledger``: the outbound ledger's effects by status, and those not confirmed."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from airflow_idempotency.cli._base import EXIT_OK, add_command, connect_read, fetch
from airflow_idempotency.cli._output import emit, print_json

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "ledger", "pending and failed external effects", handle)
    parser.add_argument("--job")
    parser.add_argument("--run-key")
    parser.add_argument(
        "--all", action="store_true", help="include succeeded effects in the summary"
    )
    parser.add_argument("--limit", type=int, default=50)


def handle(args: argparse.Namespace) -> int:
    """Effects per job, key, remote system and status, then each pending or failed one."""
    params = {"job": args.job, "run_key": args.run_key, "all": args.all, "limit": args.limit}
    with connect_read(args) as conn:
        summary = fetch(conn, args.schema, "cli_ledger_summary", params)
        problems = fetch(conn, args.schema, "cli_ledger_problems", params)
    if args.json:
        print_json({"summary": summary, "not_confirmed": problems})
        return EXIT_OK
    emit(
        args,
        "outbound ledger",
        summary,
        ["job_name", "run_key", "remote_system", "status", "effects", "last_update"],
    )
    if problems:
        emit(
            args,
            "pending and failed effects",
            problems,
            ["run_key", "idempotency_key", "status", "call_count", "last_error", "updated_at"],
        )
    return EXIT_OK
