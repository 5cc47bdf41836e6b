"""The demo's first steps: the orders seeded, then steps 1 to 3.

The nightly run (step 1), the same date again by hand (step 2) and two runs of one date at once
(step 3).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import psycopg

from devtools.airflow_env import DAGS_FOLDER
from devtools.demo.output import rel
from devtools.demo.plan import FIRST_DATE, JOBS, RACE_DATE, SEED, SLEEP_WHILE_LOCKED
from devtools.demo.rig import DemoRig
from devtools.invariants import fire_time

if str(DAGS_FOLDER) not in sys.path:  # `invoicing` lives in dags/ (dev.py puts it on the path)
    sys.path.insert(0, str(DAGS_FOLDER))


def seed(rig: DemoRig) -> None:
    """The orders of every date the steps use, seeded deterministically."""
    from invoicing.seed import seed_orders

    rows = []
    with psycopg.connect(rig.dsn, autocommit=True) as conn:
        for purpose, start, end, per_day in rig.plan.seeding():
            created = seed_orders(conn, start, end, per_day, SEED)
            span = str(start) if start == end else f"{start} .. {end}"
            rows.append((span, per_day, created, purpose))
    rig.table(
        f"Orders seeded (deterministic, seed {SEED})",
        ["business date", "orders/day", "orders", "used in"],
        rows,
    )
    total = rig.value("SELECT count(*) FROM orders")
    rig.check(total == rig.plan.total_orders, f"{total:,} orders in the job database", str(total))


def nightly_run(rig: DemoRig) -> None:
    """Step 1: the nightly run of the first business date, as the scheduler fires it."""
    day = FIRST_DATE
    rig.section(
        1,
        f"The nightly run of business date {day}",
        f"Scheduled 0 1 * * *: the run fired at {fire_time(day)} (its logical date) "
        f"processes the previous day, {day}. Triggered through the REST API with that "
        "logical date, as the scheduler would have created it.",
    )
    with rig.console.status("Airflow runs finalize_invoices ..."), rig.timed("step 1"):
        run = rig.trigger(logical_date=fire_time(day))
    rig.check_succeeded(run)
    create = rig.details(day, "create_invoices")
    totals = rig.details(day, "rebuild_totals")
    export = rig.details(day, "export_invoices")
    state = rig.date_state(day)
    rig.table(
        f"Business date {day}",
        ["", "count"],
        [
            ("orders shipped", state["orders"]),
            ("invoices created (create_invoices)", create.get("invoices_created")),
            ("daily totals rows (rebuild_totals)", totals.get("totals_rows")),
            ("exports sent (export_invoices)", export.get("exports_sent")),
            ("exports skipped, already confirmed", export.get("exports_skipped_existing")),
            ("exports failed / pending", _pair(export, "exports_failed", "exports_pending")),
            ("invoices in the accounting service", state["remote"]),
            (
                "finance summary emails delivered (email_finance_summary)",
                rig.summary_mails(day),
            ),
            ("export file invoices/2026-10-01.csv, lines", _lines(rig.export_file(day))),
        ],
    )
    rig.say(f"[dim]tasks: {rig.task_states(run.run_id)}[/dim]")
    n = state["orders"]
    rig.check(
        create.get("invoices_created") == n == export.get("exports_sent"),
        f"{n:,} orders -> {n:,} invoices created -> {n:,} exports sent",
        json.dumps({"create": create, "export": export}),
    )
    ok, detail = rig.converged(day)
    rig.check(ok, "exactly one remote invoice per order, every ledger row confirmed", detail)
    exported = rig.export_file(day)
    rig.check(
        rig.summary_mails(day) == 1 and _lines(exported) == n + 1,
        f"one finance summary email sent; the export file has {n:,} invoices",
        f"emails {rig.summary_mails(day)}, file lines {_lines(exported)}",
    )


def manual_rerun(rig: DemoRig) -> None:
    """Step 2: the same date triggered again by hand: a no-op that rewrites and resends nothing."""
    day = FIRST_DATE
    rig.section(
        2,
        f"The same date triggered again by hand: {{'run_key': '{day}'}}",
        "A manual trigger has no logical date; the conf names the business date.",
    )
    before, requests, marker = rig.fingerprint([day]), rig.requests(), rig.last_attempt_id()
    exported, mails = rig.export_file(day), len(rig.smtp.deliveries())
    with rig.console.status("Airflow runs finalize_invoices ..."), rig.timed("step 2"):
        run = rig.trigger(conf={"run_key": day.isoformat()})
    rig.check_succeeded(run)
    attempts = rig.attempts([day], marker)
    rig.table(
        "Attempts recorded by this run",
        ["job", "outcome", "triggered by", "run key"],
        [(a.job, a.outcome, a.triggered_by, a.run_key) for a in attempts],
    )
    rig.say(f"[dim]tasks: {rig.task_states(run.run_id)}[/dim]")
    rig.check(
        sorted((a.job, a.outcome) for a in attempts) == sorted((j, "noop") for j in JOBS),
        "every job recorded a noop attempt: the date was already completed",
        str(attempts),
    )
    sent = rig.requests() - requests
    rig.check(sent == 0, "0 requests to the accounting service", f"{sent} requests")
    rig.check(
        rig.fingerprint([day]) == before,
        "invoices, daily totals and ledger unchanged (not even rewritten)",
    )
    mailed = len(rig.smtp.deliveries()) - mails
    rig.check(mailed == 0, "no second finance summary email", f"{mailed} email(s) sent")
    rig.check(
        exported is not None and rig.export_file(day) == exported,
        "the export file left alone: same content, modification time and inode",
    )


def two_at_once(rig: DemoRig) -> None:
    """Step 3: two ``airflow dags test`` runs of one date at once: the lock lets one work."""
    day = RACE_DATE
    rig.section(
        3,
        f"Two runs of business date {day} at the same time",
        "Two `airflow dags test` processes (own metadata DBs, one job database) start "
        f"together; whoever gets the advisory lock works (held {SLEEP_WHILE_LOCKED} s by a "
        "fault point, to make the overlap visible), the other records lock_held, is "
        "rescheduled (30 s) and then finds the date completed.",
    )
    conf = {"run_key": day.isoformat()}
    slow = {"AIRFLOW_IDEMPOTENCY_SLEEP_AT": f"runner.after_started={SLEEP_WHILE_LOCKED}"}
    with rig.console.status("two workers run the same date ..."), rig.timed("step 3"):
        workers = [rig.start_dags_test(n, conf=conf, extra_env=slow) for n in ("A", "B")]
        codes = [w.wait(600) for w in workers]
    for worker, code in zip(workers, codes, strict=True):
        rig.say(f"[dim]worker {worker.name}: exit {code}, log {rel(worker.log)}[/dim]")
    attempts = rig.attempts([day])
    # `dags test` runs the tasks in its own process: the attempt's pid names the worker.
    owner = {w.proc.pid: w.name for w in workers}

    rig.table(
        f"Attempts on run key {day}, in order",
        ["job", "outcome", "worker", "at"],
        [(a.job, a.outcome, owner.get(a.pid, "?"), f"{a.started_at:%H:%M:%S}") for a in attempts],
    )
    rig.check(codes == [0, 0], "both Airflow runs succeeded", f"exit codes {codes}")
    held = [a for a in attempts if a.outcome == "lock_held"]
    rig.check(
        bool(held),
        f"{len(held)} lock_held attempt(s): the second run was blocked by the lock",
        lambda: f"attempts: {attempts}",
    )
    completed = sorted(a.job for a in attempts if a.outcome == "completed")
    rig.check(
        completed == sorted(JOBS),
        "each job completed exactly once; the blocked run then no-op'ed",
        str(attempts),
    )
    ok, detail = rig.converged(day)
    state = rig.date_state(day)
    rig.check(
        ok,
        f"{state['remote']:,} remote invoices for {state['orders']:,} orders: "
        "exactly one per order",
        detail,
    )


def _lines(exported: tuple[int, int, bytes] | None) -> int:
    """Lines of an export file (header included); 0 when there is none."""
    return exported[2].count(b"\n") if exported else 0


def _pair(details: dict[str, Any], a: str, b: str) -> str:
    return f"{details.get(a, '-')} / {details.get(b, '-')}"
