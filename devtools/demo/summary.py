"""Step 6 of the demo: the final bookkeeping and its checks.

job_runs, attempts, the ledger and the accounting service's invoices.
"""

from __future__ import annotations

from devtools.demo.plan import JOBS, OUTCOMES
from devtools.demo.rig import DemoRig


def _attempts_by_outcome(rig: DemoRig) -> None:
    """Step 6's table of attempts by job and outcome, with a legend of the outcomes."""
    counts: dict[str, dict[str, int]] = {}
    for job, outcome, count in rig.rows(
        "SELECT split_part(job_name, '.', 2), outcome, count(*)"
        " FROM idempotency.job_run_attempts GROUP BY 1, 2"
    ):
        counts.setdefault(job, {})[outcome] = count
    present = [o for o in OUTCOMES if any(o in c for c in counts.values())]
    present += sorted({o for c in counts.values() for o in c} - set(present))
    rig.table(
        "job_run_attempts by job and outcome",
        ["job", *present, "total"],
        [
            (job, *(c.get(o, 0) for o in present), sum(c.values()))
            for job, c in sorted(counts.items())
        ],
    )
    legend = {
        "noop": "noop = the key was already completed (steps 2, 3 and 4)",
        "lock_held": "lock_held = blocked by the run holding the key (step 3)",
        "running": "running = the attempt SIGKILLed in step 5: it never finished, its lock "
        "died with its session and the rerun took over",
    }
    for outcome, text in legend.items():
        if outcome in present:
            rig.say(f"[dim]{text}[/dim]")


def summary(rig: DemoRig) -> None:
    """Step 6: the final state, checked against the plan."""
    rig.section(6, "Final state")
    job_runs = rig.rows(
        "SELECT split_part(job_name, '.', 2), status, count(*), min(run_key), max(run_key)"
        " FROM idempotency.job_runs GROUP BY 1, 2 ORDER BY 1, 2"
    )
    rig.table(
        "job_runs (one row per job and business date)",
        ["job", "status", "run keys", "from", "to"],
        job_runs,
    )
    _attempts_by_outcome(rig)
    ledger = rig.rows(
        "SELECT status, count(*), sum(call_count) FROM idempotency.outbound_ledger"
        " WHERE remote_system = 'accounting' GROUP BY 1 ORDER BY 1"
    )
    rig.table("outbound ledger: the export", ["status", "effects", "calls"], ledger)
    others = rig.rows(
        "SELECT effect_kind, remote_system, status, count(*), sum(call_count)"
        " FROM idempotency.outbound_ledger WHERE remote_system <> 'accounting'"
        " GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
    )
    rig.table(
        "outbound ledger: emails and files", ["kind", "remote", "status", "effects", "calls"],
        others,
    )  # fmt: skip
    orders = int(rig.value("SELECT count(*) FROM orders"))
    invoices = int(rig.value("SELECT count(*) FROM invoices"))
    stats = rig.service.stats()
    duplicates = rig.rows(
        "SELECT invoice->>'order_id', count(*) FROM accounting.invoices"
        " GROUP BY 1 HAVING count(*) > 1"
    )
    unknown = rig.value(
        "SELECT count(*) FROM accounting.invoices a WHERE NOT EXISTS"
        " (SELECT FROM orders o WHERE o.order_id::text = a.invoice->>'order_id')"
    )
    rig.table(
        "Accounting service vs the job database",
        ["", "count"],
        [
            ("orders", orders),
            ("invoices (job database)", invoices),
            ("invoices (accounting service, GET /api/stats)", stats["invoices"]),
            ("orders with more than one remote invoice", len(duplicates)),
            ("remote invoices for no known order", unknown),
            ("requests served / replayed", f"{stats['requests']:,} / {stats['replays']:,}"),
        ],
    )
    expected_runs = len(JOBS) * len(rig.plan.all_dates)
    rig.check(
        [(j, s) for j, s, *_ in job_runs] == [(j, "completed") for j in sorted(JOBS)]
        and sum(r[2] for r in job_runs) == expected_runs,
        f"{expected_runs} job runs ({len(JOBS)} jobs x {len(rig.plan.all_dates)} dates),"
        " all completed",
        str(job_runs),
    )
    rig.check(
        [r[0] for r in ledger] == ["succeeded"] and ledger[0][1] == orders,
        f"{orders:,} ledger rows, all succeeded",
        str(ledger),
    )
    rig.check(
        orders == invoices == stats["invoices"] == rig.plan.total_orders,
        f"{orders:,} orders = {invoices:,} invoices = {stats['invoices']:,} remote invoices",
    )
    rig.check(
        not duplicates and unknown == 0,
        "no duplicates: exactly one remote invoice per order",
        str(duplicates[:10]),
    )
    dates = rig.plan.all_dates
    mails = [rig.summary_mails(d) for d in dates]
    files = [rig.export_file(d) is not None for d in dates]
    rig.check(
        mails == [1] * len(dates) and len(rig.smtp.deliveries()) == len(dates) and all(files),
        f"{len(dates)} finance summary emails, one per date, none twice; {len(dates)} export files",
        f"emails per date {mails}, files {files}",
    )
