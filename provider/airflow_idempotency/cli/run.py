"""``run``: one business date of a DAG through Airflow, judged by its recorded attempts.

The DAG runs through ``airflow dags test``; the outcome is read from the attempts its
idempotent tasks recorded.

Three steps, each its own function: :func:`run_dags_test` runs Airflow in a subprocess
with its output in a temporary log; :func:`judge` turns the exit code and the attempts into
a verdict and an exit code; :func:`report` prints it. The log is removed when the verdict
is a success (the attempts say it all), kept and named otherwise or with ``--keep-log``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_idempotency._sql import query_rows
from airflow_idempotency.cli import _dags
from airflow_idempotency.cli._arguments import business_date, text
from airflow_idempotency.cli._base import (
    EXIT_FAILED,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    add_command,
)
from airflow_idempotency.cli._database import connect
from airflow_idempotency.cli._output import emit, print_json
from airflow_idempotency.locks import ON_LOCKED_ENV
from airflow_idempotency.schema import current_version

if TYPE_CHECKING:
    from airflow_idempotency.cli._base import Subcommands


EXAMPLES = """
run finalize_invoices --date 2026-10-01
run finalize_invoices --date 2026-10-01 --dry-run --json
run finalize_invoices --date 2026-10-01 --force --keep-log
"""


def register(commands: Subcommands, common: argparse.ArgumentParser) -> None:
    parser = add_command(
        commands,
        common,
        "run",
        "run one business date of a DAG through Airflow",
        handle,
        EXAMPLES,
    )
    parser.add_argument("dag_id", type=text, help="the DAG's id")
    parser.add_argument(
        "--date", required=True, type=business_date, help="the business date, YYYY-MM-DD"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="conf dry_run: the work runs in a transaction rolled back, job_runs untouched",
    )
    parser.add_argument("--force", action="store_true", help="recompute a completed date")
    parser.add_argument(
        "--force-reconcile",
        action="store_true",
        help="conf force_reconcile: runs the DAG's reconcile task (the example's compares "
        "the remote with the ledger)",
    )
    parser.add_argument(
        "--keep-log", action="store_true", help="keep Airflow's log of a success too"
    )
    _dags.add_dags_folder(parser)


@dataclass(frozen=True)
class Verdict:
    """What a run came to: the words printed and the process's exit code."""

    text: str
    exit_code: int


def handle(args: argparse.Namespace) -> int:
    """Run one business date of a DAG through Airflow (`airflow dags test`) and classify it.

    Exit 0 completed (or a no-op: completed already), 1 failed, 2 refused before anything
    ran (a key that would be refused, a DAG without an idempotent task), 75 locked elsewhere.
    """
    conf: dict[str, Any] = {"run_key": args.date, "force": args.force, "dry_run": args.dry_run}
    if args.force_reconcile:
        conf["force_reconcile"] = True
    refuse_unless_runnable(args, conf)
    with connect(args) as conn:
        since = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    code, log = run_dags_test(args.dag_id, conf, args.dags_folder)
    with connect(args) as conn:
        attempts = (
            query_rows(
                conn,
                "cli_attempts_since",
                args.schema,
                {"run_key": args.date, "dag_id": args.dag_id, "since": since},
            )
            if current_version(conn, args.schema)
            else []
        )
    verdict = judge(code, [a["outcome"] for a in attempts], dry_run=args.dry_run)
    kept = verdict.exit_code != EXIT_OK or args.keep_log
    if not kept:
        log.unlink()  # nothing to look at: the attempts say it all
    report(args, verdict, attempts, log if kept else None)
    return verdict.exit_code


def refuse_unless_runnable(args: argparse.Namespace, conf: Mapping[str, Any]) -> None:
    """Exit 2 before anything runs (nothing written) when a task's key would be refused, e.g.
    a period that has not ended, or when the DAG has no idempotent task at all."""
    refused = [e for e in _dags.explain(args, "manual", None, conf) if e.run_key is None]
    if refused:
        reasons = "; ".join(f"{e.task_id}: {e.explanation}" for e in refused)
        raise CommandError(f"{args.dag_id} {args.date} refused, nothing ran: {reasons}", EXIT_USAGE)


def run_dags_test(
    dag_id: str, conf: Mapping[str, Any], dags_folder: str | None = None
) -> tuple[int, Path]:
    """``airflow dags test DAG_ID -c CONF`` in a subprocess; its exit code and the temporary
    file holding its output (the caller removes it).

    A locked key fails the task at once instead of rescheduling it: `dags test` would wait
    in the foreground for as long as the other execution holds the lock."""
    env = {**os.environ, ON_LOCKED_ENV: "fail"}
    if dags_folder:  # the folder the DAG was read from is the one Airflow runs
        env["AIRFLOW__CORE__DAGS_FOLDER"] = dags_folder
    command = [sys.executable, "-m", "airflow", "dags", "test", dag_id, "-c", json.dumps(conf)]
    with tempfile.NamedTemporaryFile(
        "w+", prefix=f"{dag_id}-{conf['run_key']}-", suffix=".log", delete=False
    ) as log:
        code = subprocess.run(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False
        ).returncode
    return code, Path(log.name)


def judge(code: int, outcomes: Collection[str], *, dry_run: bool) -> Verdict:
    """The verdict on a run from Airflow's exit ``code`` and the ``outcomes`` of the attempts
    it recorded: locked elsewhere wins (exit 75); no attempt, a failed or lost one, or a
    failing Airflow is a failure; only no-ops is a no-op; anything else completed. A
    ``deferred`` attempt decides nothing (its resumption is another attempt): a run that only
    deferred is not completed."""
    found = set(outcomes) - {"deferred"}
    if "lock_held" in found:
        return Verdict("locked elsewhere", EXIT_LOCKED)
    if code != 0 or not found or found & {"failed", "lock_lost"}:
        return Verdict("failed", EXIT_FAILED)
    if found == {"noop"}:
        return Verdict("no-op: already completed", EXIT_OK)
    return Verdict("dry run" if dry_run else "completed", EXIT_OK)


def report(
    args: argparse.Namespace,
    verdict: Verdict,
    attempts: Sequence[dict[str, Any]],
    log: Path | None,
) -> None:
    """Print the verdict, the holder of a lock that refused the run, the attempts and the
    kept log's path; on a failure that recorded nothing, the log's last lines (stderr)."""
    if args.json:
        print_json(
            {
                "dag_id": args.dag_id,
                "run_key": args.date,
                "verdict": verdict.text,
                "exit_code": verdict.exit_code,
                "attempts": attempts,
                "log": str(log) if log else None,
            }
        )
        return
    print(f"{args.dag_id} {args.date}: {verdict.text}")
    holders = [a["error"] for a in attempts if a["outcome"] == "lock_held" and a["error"]]
    for holder in holders[-1:]:
        print(holder)
    emit(args, "attempts of this run", attempts, ["job_name", "run_key", "outcome", "error"])
    if log:
        print(f"log: {log}")
        if verdict.exit_code == EXIT_FAILED and not attempts:
            lines = log.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
            print("".join(lines[-30:]), file=sys.stderr)
