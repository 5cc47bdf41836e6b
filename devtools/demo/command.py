"""`python3 dev.py demo`: the invoice-finalization DAG through REAL Airflow, step by step.

What it runs, against a fresh PostgreSQL database and the accounting HTTP service:

1. seed orders, then the nightly run of business date 2026-10-01 (fired 2026-10-02 01:00):
   invoices, totals, the export to accounting, the date's export file and the finance
   summary email (to a local SMTP server the demo starts, which counts what it delivers);
2. the same date triggered again by hand (conf run_key): a no-op, no second email, the
   export file untouched;
3. two runs of one date at once (two ``airflow dags test`` processes): the lock lets one
   work, the other waits and then no-ops;
4. ``airflow backfill create`` over a week, then the same week again with
   ``--reprocess-behavior completed``: all no-ops;
5. a worker SIGKILLed in the middle of the export, then the rerun;
6. the final bookkeeping: job_runs, attempts, ledger, the accounting service's invoices.

Each step checks what it claims and the demo exits 1 at the first check that fails, so it
is also an end-to-end test (tests/stack/test_demo.py runs ``--quick``). Airflow's own output goes
to log files under the work folder (``.demo/`` by default, wiped at start); the terminal
shows a summary. The scheduler, api-server and dag-processor, the accounting service, the
``dags test`` workers and an embedded PostgreSQL are all stopped at the end, also after a
failure or Ctrl-C. AIRFLOW* variables of the calling shell are ignored.

    python3 dev.py demo [--orders N] [--quick] [--keep] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from rich.console import Console

from devtools.airflow_env import DAGS_FOLDER, ROOT
from devtools.demo import backfill, crash, first_runs, summary
from devtools.demo.output import DemoFailure, rel
from devtools.demo.plan import CRASH_DATE, DAG_ID, Plan
from devtools.demo.processes import cleaning_begins, leftover_processes, on_signal, shielded
from devtools.demo.rig import DemoRig


def run(rig: DemoRig) -> None:
    """The whole demo: set-up, Airflow started, the six steps, everything stopped."""
    from devtools.airflow_stack import airflow_stack

    started = time.monotonic()
    with contextlib.ExitStack() as resources:
        try:
            rig.console.rule("[bold]Idempotent nightly batch jobs: a guided demo", style="bold")
            rig.say(f"work folder {rel(rig.workdir)}/ (Airflow home, logs; wiped at start)")
            with rig.timed("set-up"):
                rig.setup_database(resources)
                rig.say(f"PostgreSQL: {rig.server_note}, database [bold]{rig.db_name}[/]")
                rig.start_service(resources)
                rig.say(f"accounting service: {rig.service.url} (pid {rig.service.pid})")
                resources.callback(rig.kill_workers)
                first_runs.seed(rig)
            home = rig.workdir / "airflow"
            rig.say(
                "starting Airflow: api-server, scheduler, dag-processor "
                f"[dim](logs in {rel(home / 'stack-logs')}/)[/dim]"
            )
            airflow = contextlib.ExitStack()
            resources.callback(airflow.close)
            with rig.console.status("Airflow is starting ..."), rig.timed("Airflow start"):
                rig.stack = airflow.enter_context(
                    airflow_stack(home, DAGS_FOLDER, rig.conn_env, start_timeout=300)
                )
                rig.stack.unpause(DAG_ID, timeout=300)
            rig.say(
                f"Airflow answers on {rig.stack.base_url} after "
                f"{rig.timings['Airflow start']:.0f} s; {DAG_ID} unpaused"
            )
            first_runs.nightly_run(rig)
            first_runs.manual_rerun(rig)
            first_runs.two_at_once(rig)
            backfill.backfill_again(rig, backfill.backfill(rig))
            crash.rerun_after_crash(rig, crash.crash(rig))
            with shielded(), rig.timed("Airflow stop"):
                airflow.close()
            summary.summary(rig)
        finally:
            cleaning_begins()
    rig.timings["total"] = time.monotonic() - started


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 dev.py demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--orders", type=int, help="orders of business date 2026-10-01 (default 1287; 200 quick)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller numbers and a 3-day backfill (the test)"
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the work folder and the database afterwards (until the next demo run)",
    )
    parser.add_argument(
        "--workdir", type=Path, default=ROOT / ".demo", help="work folder (default .demo/)"
    )
    args = parser.parse_args(argv)
    if args.orders is not None and args.orders < 1:
        parser.error("--orders must be at least 1")
    return args


def next_steps(demo: DemoRig, console: Console) -> None:
    """What to run next: the operator CLI, Airflow's CLI and psql on what the demo left."""
    workdir = rel(demo.workdir)
    console.print()
    console.rule("[bold]Next", align="left")
    if demo.args.keep:
        console.print(
            f"  Kept: {workdir}/ and database {demo.db_name} (dropped by the next demo run).",
            highlight=False,
        )
        if demo.server_source == "embedded":
            data = rel(ROOT / ".pgdata" / "data")
            console.print(
                "  The embedded server was stopped. Start it (it stays up) and stop it with\n"
                f"    .venv/bin/python -c \"import pgserver; pgserver.get_server('{data}', "
                'cleanup_mode=None)"\n'
                f"    .venv/bin/python -c \"import pgserver; pgserver.get_server('{data}')\"",
                highlight=False,
                soft_wrap=True,
            )
    else:
        console.print(
            "  The database was dropped and the work folder removed. To look around, run "
            "[bold]python3 dev.py demo --keep[/], then:",
            highlight=False,
        )
    commands = [
        ("in a new shell: AIRFLOW_HOME, connections and AIRFLOW_IDEMPOTENCY_DSN of the demo",
         f"source {workdir}/env.sh"),
        ("job runs, one run with its attempts, the ledger: the operator CLI",
         "python3 dev.py cli runs"),
        ("", f"python3 dev.py cli show {DAG_ID}.export_invoices {CRASH_DATE}"),
        ("", "python3 dev.py cli ledger --all"),
        ("the demo's Airflow runs", f".venv/bin/airflow dags list-runs {DAG_ID}"),
        ("the job database", 'psql "$AIRFLOW_IDEMPOTENCY_DSN"'),
        ("the same demo with 1,287 orders on 2026-10-01 and a 7-day backfill",
         "python3 dev.py demo"),
    ]  # fmt: skip
    if not demo.args.quick:
        commands.pop()
    for what, command in commands:
        if what:
            console.print(f"  [dim]# {what}[/dim]", highlight=False)
        console.print(f"  {command}", highlight=False, soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    width = None if sys.stdout.isatty() else 110
    console = Console(width=width, highlight=False)
    for var in [k for k in os.environ if k.startswith("AIRFLOW")]:
        del os.environ[var]  # the demo's Airflow must not see the caller's settings
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    workdir = args.workdir.resolve()
    _lock = prepare_workdir(workdir)
    demo = DemoRig(
        args=args, console=console, workdir=workdir, plan=Plan.build(args.quick, args.orders)
    )
    failure: str | None = None
    try:
        run(demo)
    except DemoFailure as exc:
        failure = f"a check failed: {exc}"
    except KeyboardInterrupt as exc:
        failure = f"interrupted ({exc or 'SIGINT'})"
    except Exception as exc:  # reported with its traceback file, then exit 1
        trace = workdir / "logs" / "demo-traceback.log"
        trace.write_text(traceback.format_exc())
        failure = f"{type(exc).__name__}: {exc}\n(traceback in {rel(trace)})"
    left = leftover_processes(workdir, demo.db_name, wait=10.0)
    if left:
        failure = (
            (failure + "\n" if failure else "") + "processes left running:\n  " + "\n  ".join(left)
        )
    if failure:
        console.print()
        console.print(f"[bold red]DEMO FAILED[/]: {failure}", highlight=False)
        console.print(
            f"  logs: {rel(workdir / 'logs')}/, {rel(workdir / 'airflow' / 'stack-logs')}/, "
            f"task logs in {rel(workdir / 'airflow' / 'logs')}/ (kept)",
            highlight=False,
        )
        return 130 if failure.startswith("interrupted") else 1

    console.print()
    console.rule("[bold green]All checks passed", align="left", style="green")
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in demo.timings.items() if k != "total")
    console.print(
        f"  {demo.checks} checks passed in {demo.timings['total']:.0f} s ({timing})",
        highlight=False,
    )
    console.print(
        "  no process left running (Airflow, accounting service, workers)", highlight=False
    )
    next_steps(demo, console)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def prepare_workdir(workdir: Path) -> IO[str]:
    """Lock the work folder (one demo at a time per folder) and empty it; return the lock."""
    if workdir.is_dir() and any(workdir.iterdir()) and not (workdir / ".lock").exists():
        raise SystemExit(
            f"{workdir} is not empty and is not a demo work folder (no .lock file): "
            "refusing to wipe it; pass an empty or new folder as --workdir"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    lock = open(workdir / ".lock", "w")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(
            f"another demo is running in {rel(workdir)}/; wait for it, or pass --workdir"
        ) from None
    for entry in workdir.iterdir():
        if entry.name in (".lock", "database"):  # "database": dropped once the server is up
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    (workdir / "logs").mkdir()
    return lock


if __name__ == "__main__":
    raise SystemExit(main())
