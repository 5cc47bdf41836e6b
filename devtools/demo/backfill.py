"""Step 4 of the demo: a backfill over a week, then the same week again (all no-ops).

``airflow backfill create`` over the week, then again with ``--reprocess-behavior completed``.
"""

from __future__ import annotations

from typing import Any

from devtools.demo.output import DemoFailure
from devtools.demo.plan import DAG_ID, JOBS
from devtools.demo.rig import DemoRig
from devtools.invariants import fire_time


def _backfill(rig: DemoRig, reprocess_behavior: str) -> list[Any]:
    """``airflow backfill create`` over the week through the stack helper; return the run
    of every date of the week, once all are finished.

    The helper pauses the DAG while the CLI creates the runs, runs the CLI again when a
    write failed with SQLite's "database is locked" (frequent on a busy machine), lets a
    backfill that such a failure left half made finish first, and marks the backfill
    complete itself (the scheduler does it only every 30 s) so the next one can start.
    """
    week = rig.plan.week
    fires = [fire_time(d) for d in week]
    before = rig.stack.latest_backfill_id(DAG_ID) or 0
    runs: list[Any] = rig.stack.backfill(
        DAG_ID, fires[0], fires[-1], reprocess_behavior=reprocess_behavior, timeout=900
    )
    latest = rig.stack.latest_backfill_id(DAG_ID) or 0
    if latest - before > 1:
        rig.say(
            f'[yellow]note[/]: `airflow backfill create` hit SQLite\'s "database is locked" '
            f"and was run again ({latest - before} backfills created)"
        )
    got = [r.logical_date.isoformat() if r.logical_date else None for r in runs]
    if got != fires:
        raise DemoFailure(f"backfill runs for {got}, expected one per fire time {fires}")
    return runs


def backfill(rig: DemoRig) -> int:
    """The first half of step 4: the backfill; return the requests it made."""
    week = rig.plan.week
    start, end = fire_time(week[0]), fire_time(week[-1])
    rig.section(
        4,
        f"A backfill of {week[0]} .. {week[-1]}, then the same range again",
        f"airflow backfill create --dag-id {DAG_ID} --from-date {start} --to-date {end}",
    )
    requests = rig.requests()
    with rig.console.status(f"backfill of {len(week)} dates ..."), rig.timed("step 4a"):
        first = _backfill(rig, "none")
    rig.check(
        [r.state for r in first] == ["success"] * len(week),
        f"{len(first)} backfill runs, all success",
        rig.run_failed([r.run_id for r in first]),
    )
    rows = []
    for run, day in zip(first, week, strict=True):
        s, export = rig.date_state(day), rig.details(day, "export_invoices")
        logical = f"{run.logical_date:%Y-%m-%d %H:%M}" if run.logical_date else "-"
        sent = export.get("exports_sent")
        rows.append((day, logical, run.state, s["orders"], s["invoices"], sent, s["remote"]))
    rig.table(
        "First pass",
        ["business date", "logical date", "run", "orders", "invoices", "sent", "remote"],
        rows,
    )
    for day in week:
        ok, detail = rig.converged(day)
        if not ok:
            rig.check(False, "every date converged", detail)
    rig.check(True, "every date: one invoice and one remote invoice per order")
    return rig.requests() - requests


def backfill_again(rig: DemoRig, first_requests: int) -> None:
    """The second half of step 4: the same range, all no-ops (``first_requests``: what the
    first pass sent)."""
    week = rig.plan.week
    before, requests, marker = rig.fingerprint(week), rig.requests(), rig.last_attempt_id()
    rig.say("The same range again, with [bold]--reprocess-behavior completed[/]:")
    status = rig.console.status("the same backfill, --reprocess-behavior completed ...")
    with status, rig.timed("step 4b"):
        second = _backfill(rig, "completed")
    rig.check(
        [r.state for r in second] == ["success"] * len(week)
        and all(r.clear_number > 0 for r in second),
        f"the {len(second)} completed runs were cleared and ran again, all success",
        rig.run_failed([r.run_id for r in second]),
    )
    attempts = rig.attempts(week, marker)
    by_job: dict[str, dict[str, int]] = {}
    for a in attempts:
        by_job.setdefault(a.job, {}).setdefault(a.outcome, 0)
        by_job[a.job][a.outcome] += 1
    rig.table(
        "Second pass: attempts by job",
        ["job", "noop", "completed", "other"],
        [
            (
                job,
                by_job.get(job, {}).get("noop", 0),
                by_job.get(job, {}).get("completed", 0),
                sum(n for k, n in by_job.get(job, {}).items() if k not in ("noop", "completed")),
            )
            for job in JOBS
        ],
    )
    covered = {(a.job, a.run_key) for a in attempts}
    rig.check(
        {a.outcome for a in attempts} == {"noop"}
        and {a.triggered_by for a in attempts} == {"backfill"}
        and covered == {(j, d.isoformat()) for j in JOBS for d in week},
        f"all {len(attempts)} attempts of the second pass are no-ops (every job, every date)",
        str(attempts),
    )
    sent = rig.requests() - requests
    rig.check(
        sent == 0,
        f"0 requests to the accounting service (the first pass made {first_requests:,})",
        f"{sent} requests",
    )
    rig.check(rig.fingerprint(week) == before, "nothing rewritten in the job database")
