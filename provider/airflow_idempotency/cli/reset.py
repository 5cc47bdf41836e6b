"""``reset``: mark a failed or stuck run failed, with a reason, so the next run takes it over."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from airflow_idempotency import records
from airflow_idempotency._sql import query_rows
from airflow_idempotency.cli._arguments import text
from airflow_idempotency.cli._base import EXIT_LOCKED, EXIT_OK, CommandError, add_command
from airflow_idempotency.cli._database import connect_write
from airflow_idempotency.cli._output import spelling_note
from airflow_idempotency.leases import lease_is_live
from airflow_idempotency.locks import hold_run_lock, run_lock_key
from airflow_idempotency.records import Trigger

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands,
        common,
        "reset",
        "mark a failed or stuck run failed, with a reason",
        handle,
        'reset finalize_invoices.export_invoices 2026-10-01 --reason "worker host lost"',
    )
    parser.add_argument("job", type=text, help="the job name")
    parser.add_argument("run_key", type=text, help="the run key, e.g. 2026-10-01")
    parser.add_argument(
        "--reason", type=text, required=True, help="why (recorded in job_runs and the attempts)"
    )


def handle(args: argparse.Namespace) -> int:
    """Mark a failed or stuck run failed with a reason, so the next run takes it over cleanly.

    Refused (exit 75) while a worker holds the key's lock, and (exit 1) for a key that is
    completed or was never run."""
    lock_key = run_lock_key(args.job, args.run_key)
    with (
        connect_write(args) as conn,
        hold_run_lock(
            conn, lock_key, schema=args.schema, application_name="airflow-idempotency reset"
        ) as lock,
    ):
        if lock is None or lease_is_live(conn, args.job, args.run_key, schema=args.schema):
            raise CommandError(
                f"run key {args.run_key!r} of {args.job!r} is locked: a worker is running it now "
                "(see `airflow-idempotency locks`). Not resetting.",
                EXIT_LOCKED,
            )
        run = records.get_run(conn, args.schema, args.job, args.run_key)
        if run is None or run.status not in ("failed", "started"):
            status = run.status if run else "never run"
            raise CommandError(
                f"nothing reset: job {args.job!r} run_key {args.run_key!r} is {status}, not "
                "failed or started (a completed run is recomputed with force=true instead)."
                + spelling_note(args.run_key)
            )
        # In the lock transaction: the reset attempt and the reset itself commit together.
        trigger = Trigger(triggered_by="cli", triggering_user=os.environ.get("USER"))
        reset = records.RunRecords(
            args.schema, records.RunIdentity(args.job, args.run_key, trigger)
        )
        attempt_id = reset.insert_attempt(
            conn, "reset", lock=lock, options=records.RunOptions(), error=args.reason
        )
        query_rows(
            conn,
            "reset_run",
            args.schema,
            {
                "job": args.job,
                "run_key": args.run_key,
                "reason": args.reason,
                "attempt_id": attempt_id,
            },
        )
    print(f"reset {args.job} {args.run_key} to failed (reason recorded, attempt {attempt_id})")
    return EXIT_OK
