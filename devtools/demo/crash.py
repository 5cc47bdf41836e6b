"""Step 5 of the demo: a worker SIGKILLed in the middle of the export, then the rerun.

The rerun takes over what the killed worker left.
"""

from __future__ import annotations

from devtools.demo.output import rel
from devtools.demo.plan import CRASH_DATE
from devtools.demo.rig import DemoRig
from devtools.invariants import fire_time


def crash(rig: DemoRig) -> dict[str, int]:
    """The first half of step 5: the crash; return the state it left."""
    day, at, n = CRASH_DATE, rig.plan.crash_at, rig.plan.crash_orders
    point = f"ledger.after_remote_commit@{at}"
    rig.section(
        5,
        f"A worker killed in the middle of the export of {day}, then the rerun",
        f"`airflow dags test` of the nightly run with AIRFLOW_IDEMPOTENCY_CRASH_AT={point}: "
        f"SIGKILL right after the accounting service committed invoice #{at}, before the "
        "ledger recorded it. The ledger claims (pending) and confirms invoices 50 at a "
        "time, 16 calls in flight.",
    )
    with rig.console.status("the worker runs until it is killed ..."), rig.timed("step 5a"):
        worker = rig.start_dags_test(
            "crash",
            logical_date=fire_time(day),
            extra_env={"AIRFLOW_IDEMPOTENCY_CRASH_AT": point},
        )
        code = worker.wait(600)
        worker.kill()  # whatever it had started dies with it
    rig.check(
        f"fault point {point}: SIGKILL" in worker.text(),
        f"the worker was SIGKILLed at {point} (exit {code}, log {rel(worker.log)})",
        f"no SIGKILL in {rel(worker.log)}; exit {code}",
    )
    middle = rig.date_state(day)
    claimed = middle["ledger_succeeded"] + middle["ledger_pending"] + middle["ledger_failed"]
    status = rig.rows(
        "SELECT split_part(job_name, '.', 2), status FROM idempotency.job_runs"
        " WHERE run_key = %s ORDER BY job_name",
        (day.isoformat(),),
    )
    locks = rig.value(
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
        " WHERE l.locktype = 'advisory' AND d.datname = current_database()"
    )
    rig.table(
        "Left behind by the crash",
        ["", "count"],
        [
            ("orders = invoices to export", n),
            ("invoices the accounting service has", middle["remote"]),
            ("ledger: confirmed (succeeded)", middle["ledger_succeeded"]),
            ("ledger: pending (claimed; sent or not, nobody knows)", middle["ledger_pending"]),
            ("ledger: not claimed yet", n - claimed),
            ("job_runs", ", ".join(f"{j} {st}" for j, st in status)),
            ("advisory locks held (died with the session)", locks),
        ],
    )
    rig.check(
        0 < middle["ledger_succeeded"] < middle["remote"] < n
        and middle["ledger_pending"] > 0
        and locks == 0,
        "the export stopped half-way: confirmed, pending and unsent invoices; no lock left",
        str(middle),
    )
    return middle


def rerun_after_crash(rig: DemoRig, middle: dict[str, int]) -> None:
    """The second half of step 5: the rerun takes over what the crash left (``middle``)."""
    day, n = CRASH_DATE, rig.plan.crash_orders
    requests, replays = rig.requests(), int(rig.service.stats()["replays"])
    rig.say(f"The rerun, by hand through Airflow: conf {{'run_key': '{day}'}}")
    with rig.console.status("Airflow reruns the date ..."), rig.timed("step 5b"):
        run = rig.trigger(conf={"run_key": day.isoformat()})
    rig.check_succeeded(run)
    export = rig.details(day, "export_invoices")
    after = rig.date_state(day)
    replayed = int(rig.service.stats()["replays"]) - replays
    rig.table(
        "The rerun (export_invoices took over the started run)",
        ["", "count"],
        [
            ("skipped: confirmed before the crash", export.get("exports_skipped_existing")),
            ("sent: pending and unclaimed, each with its SAME key", export.get("exports_sent")),
            ("  of which the service already had (replayed)", replayed),
            ("requests to the service", rig.requests() - requests),
            ("invoices the accounting service has now", after["remote"]),
        ],
    )
    rig.check(
        export.get("exports_skipped_existing") == middle["ledger_succeeded"]
        and export.get("exports_sent") == n - middle["ledger_succeeded"],
        f"the {middle['ledger_succeeded']} confirmed invoices were not sent again, "
        f"the other {n - middle['ledger_succeeded']} were",
        str(export),
    )
    lost = middle["remote"] - middle["ledger_succeeded"]
    rig.check(
        replayed >= lost,
        f"the {lost} the service got before the crash were answered from its idempotency "
        "keys, not created again",
        f"replays {replayed}, expected at least {lost}",
    )
    ok, detail = rig.converged(day)
    rig.check(ok, f"{after['remote']:,} remote invoices for {n:,} orders: no duplicate", detail)
