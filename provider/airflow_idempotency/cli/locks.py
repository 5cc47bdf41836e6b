"""``locks``: the run keys locked right now, and by whom.

By a session's advisory lock, or by a worker's lease (the lease mode), live or expired (free
to take over)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from airflow_idempotency._sql import query_rows
from airflow_idempotency.cli._base import EXIT_OK, add_command
from airflow_idempotency.cli._database import connect_read
from airflow_idempotency.cli._output import emit

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    add_command(
        commands, common, "locks", "run keys locked now, by whom", handle, "locks\nlocks --json"
    )


def handle(args: argparse.Namespace) -> int:
    """The run locks held now: the key, its status, the session (advisory mode) or the lease
    (lease mode: its token, worker and expiry; an expired one is free to take over) and the
    worker holding it."""
    with connect_read(args) as conn:
        rows = query_rows(conn, "cli_locks", args.schema)
    emit(
        args,
        "held run locks",
        rows,
        [
            "job_name",
            "run_key",
            "status",
            "lock_mode",
            "state",
            "backend_pid",
            "client",
            "lease_token",
            "lease_holder",
            "lease_expires_at",
            "worker_host",
            "worker_pid",
            "attempt_started_at",
            "dag_id",
        ],
    )
    return EXIT_OK
