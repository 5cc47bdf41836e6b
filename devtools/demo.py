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
import datetime as dt
import json
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from rich.console import Console

from devtools.airflow_env import DAGS_FOLDER, ROOT
from devtools.demo_support import (
    DAG_ID,
    DemoFailure,
    DemoRig,
    cleaning_begins,
    leftover_processes,
    on_signal,
    prepare_workdir,
    rel,
    shielded,
)
from devtools.invariants import fire_time

if str(DAGS_FOLDER) not in sys.path:  # `invoicing` lives in dags/ (dev.py puts it on the path)
    sys.path.insert(0, str(DAGS_FOLDER))

JOBS = (
    "create_invoices", "rebuild_totals", "export_invoices", "write_export_file",
    "email_finance_summary",
)  # fmt: skip
SEED = 42
FIRST_DATE = dt.date(2026, 10, 1)
RACE_DATE = dt.date(2026, 10, 9)
CRASH_DATE = dt.date(2026, 10, 10)
SLEEP_WHILE_LOCKED = 20  # seconds the winner of the race holds the lock (fault point)
OUTCOMES = ("completed", "noop", "lock_held", "running", "failed", "lock_lost", "dry_run")


@dataclass(frozen=True)
class Plan:
    """The numbers of one demo run."""

    first_orders: int
    week: tuple[dt.date, ...]
    week_orders: int
    race_orders: int
    crash_orders: int
    crash_at: int

    @classmethod
    def build(cls, quick: bool, orders: int | None) -> Plan:
        if quick:
            return cls(orders or 200, _days(dt.date(2026, 10, 2), 3), 30, 40, 120, 70)
        return cls(orders or 1287, _days(dt.date(2026, 10, 2), 7), 200, 200, 300, 120)

    def seeding(self) -> list[tuple[str, dt.date, dt.date, int]]:
        return [
            ("steps 1-2: nightly run, manual rerun", FIRST_DATE, FIRST_DATE, self.first_orders),
            ("step 4: backfill", self.week[0], self.week[-1], self.week_orders),
            ("step 3: two runs at once", RACE_DATE, RACE_DATE, self.race_orders),
            ("step 5: crash mid-export", CRASH_DATE, CRASH_DATE, self.crash_orders),
        ]

    @property
    def all_dates(self) -> list[dt.date]:
        return [FIRST_DATE, *self.week, RACE_DATE, CRASH_DATE]

    @property
    def total_orders(self) -> int:
        return sum(n * ((b - a).days + 1) for _, a, b, n in self.seeding())


def _days(start: dt.date, count: int) -> tuple[dt.date, ...]:
    return tuple(start + dt.timedelta(days=i) for i in range(count))


# -- the demo -------------------------------------------------------------------------


@dataclass(kw_only=True)
class Demo(DemoRig):
    """The narrated steps (the plumbing they use: :class:`DemoRig`)."""

    plan: Plan

    def seed(self) -> None:
        from invoicing.seed import seed_orders

        rows = []
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for purpose, start, end, per_day in self.plan.seeding():
                created = seed_orders(conn, start, end, per_day, SEED)
                span = str(start) if start == end else f"{start} .. {end}"
                rows.append((span, per_day, created, purpose))
        self.table(
            f"Orders seeded (deterministic, seed {SEED})",
            ["business date", "orders/day", "orders", "used in"],
            rows,
        )
        total = self.value("SELECT count(*) FROM orders")
        self.check(
            total == self.plan.total_orders, f"{total:,} orders in the job database", str(total)
        )

    # ---------------------------------------------------------------- steps

    def step_nightly_run(self) -> None:
        day = FIRST_DATE
        self.section(
            1,
            f"The nightly run of business date {day}",
            f"Scheduled 0 1 * * *: the run fired at {fire_time(day)} (its logical date) "
            f"processes the previous day, {day}. Triggered through the REST API with that "
            "logical date, as the scheduler would have created it.",
        )
        with self.console.status("Airflow runs finalize_invoices ..."), self.timed("step 1"):
            run = self.trigger(logical_date=fire_time(day))
        self.check(
            run.state == "success",
            f"Airflow run {run.run_id} finished: {run.state}",
            self.run_failed([run.run_id]),
        )
        create = self.details(day, "create_invoices")
        totals = self.details(day, "rebuild_totals")
        export = self.details(day, "export_invoices")
        state = self.date_state(day)
        self.table(
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
                    self.summary_mails(day),
                ),
                ("export file invoices/2026-10-01.csv, lines", _lines(self.export_file(day))),
            ],
        )
        self.say(f"[dim]tasks: {self.task_states(run.run_id)}[/dim]")
        n = state["orders"]
        self.check(
            create.get("invoices_created") == n == export.get("exports_sent"),
            f"{n:,} orders -> {n:,} invoices created -> {n:,} exports sent",
            json.dumps({"create": create, "export": export}),
        )
        ok, detail = self.converged(day)
        self.check(ok, "exactly one remote invoice per order, every ledger row confirmed", detail)
        exported = self.export_file(day)
        self.check(
            self.summary_mails(day) == 1 and _lines(exported) == n + 1,
            f"one finance summary email sent; the export file has {n:,} invoices",
            f"emails {self.summary_mails(day)}, file lines {_lines(exported)}",
        )

    def step_manual_rerun(self) -> None:
        day = FIRST_DATE
        self.section(
            2,
            f"The same date triggered again by hand: {{'run_key': '{day}'}}",
            "A manual trigger has no logical date; the conf names the business date.",
        )
        before, requests, marker = self.fingerprint([day]), self.requests(), self.last_attempt_id()
        exported, mails = self.export_file(day), len(self.smtp.deliveries())
        with self.console.status("Airflow runs finalize_invoices ..."), self.timed("step 2"):
            run = self.trigger(conf={"run_key": day.isoformat()})
        self.check(
            run.state == "success",
            f"Airflow run {run.run_id} finished: {run.state}",
            self.run_failed([run.run_id]),
        )
        attempts = self.attempts([day], marker)
        self.table(
            "Attempts recorded by this run",
            ["job", "outcome", "triggered by", "run key"],
            [(a.job, a.outcome, a.triggered_by, a.run_key) for a in attempts],
        )
        self.say(f"[dim]tasks: {self.task_states(run.run_id)}[/dim]")
        self.check(
            sorted((a.job, a.outcome) for a in attempts) == sorted((j, "noop") for j in JOBS),
            "every job recorded a noop attempt: the date was already completed",
            str(attempts),
        )
        sent = self.requests() - requests
        self.check(sent == 0, "0 requests to the accounting service", f"{sent} requests")
        self.check(
            self.fingerprint([day]) == before,
            "invoices, daily totals and ledger unchanged (not even rewritten)",
        )
        mailed = len(self.smtp.deliveries()) - mails
        self.check(mailed == 0, "no second finance summary email", f"{mailed} email(s) sent")
        self.check(
            exported is not None and self.export_file(day) == exported,
            "the export file left alone: same content, modification time and inode",
        )

    def step_two_at_once(self) -> None:
        day = RACE_DATE
        self.section(
            3,
            f"Two runs of business date {day} at the same time",
            "Two `airflow dags test` processes (own metadata DBs, one job database) start "
            f"together; whoever gets the advisory lock works (held {SLEEP_WHILE_LOCKED} s by a "
            "fault point, to make the overlap visible), the other records lock_held, is "
            "rescheduled (30 s) and then finds the date completed.",
        )
        conf = {"run_key": day.isoformat()}
        slow = {"AIRFLOW_IDEMPOTENCY_SLEEP_AT": f"runner.after_started={SLEEP_WHILE_LOCKED}"}
        with self.console.status("two workers run the same date ..."), self.timed("step 3"):
            workers = [self.start_dags_test(n, conf=conf, extra_env=slow) for n in ("A", "B")]
            codes = [w.wait(600) for w in workers]
        for worker, code in zip(workers, codes, strict=True):
            self.say(f"[dim]worker {worker.name}: exit {code}, log {rel(worker.log)}[/dim]")
        attempts = self.attempts([day])
        # `dags test` runs the tasks in its own process: the attempt's pid names the worker.
        owner = {w.proc.pid: w.name for w in workers}

        self.table(
            f"Attempts on run key {day}, in order",
            ["job", "outcome", "worker", "at"],
            [
                (a.job, a.outcome, owner.get(a.pid, "?"), f"{a.started_at:%H:%M:%S}")
                for a in attempts
            ],
        )
        self.check(codes == [0, 0], "both Airflow runs succeeded", f"exit codes {codes}")
        held = [a for a in attempts if a.outcome == "lock_held"]
        self.check(
            bool(held),
            f"{len(held)} lock_held attempt(s): the second run was blocked by the lock",
            lambda: f"attempts: {attempts}",
        )
        completed = sorted(a.job for a in attempts if a.outcome == "completed")
        self.check(
            completed == sorted(JOBS),
            "each job completed exactly once; the blocked run then no-op'ed",
            str(attempts),
        )
        ok, detail = self.converged(day)
        state = self.date_state(day)
        self.check(
            ok,
            f"{state['remote']:,} remote invoices for {state['orders']:,} orders: "
            "exactly one per order",
            detail,
        )

    def backfill(self, reprocess_behavior: str) -> list[Any]:
        """``airflow backfill create`` over the week through the stack helper; return the run
        of every date of the week, once all are finished.

        The helper pauses the DAG while the CLI creates the runs, runs the CLI again when a
        write failed with SQLite's "database is locked" (frequent on a busy machine), lets a
        backfill that such a failure left half made finish first, and marks the backfill
        complete itself (the scheduler does it only every 30 s) so the next one can start.
        """
        week = self.plan.week
        fires = [fire_time(d) for d in week]
        before = self.stack.latest_backfill_id(DAG_ID) or 0
        runs: list[Any] = self.stack.backfill(
            DAG_ID, fires[0], fires[-1], reprocess_behavior=reprocess_behavior, timeout=900
        )
        latest = self.stack.latest_backfill_id(DAG_ID) or 0
        if latest - before > 1:
            self.say(
                f'[yellow]note[/]: `airflow backfill create` hit SQLite\'s "database is locked" '
                f"and was run again ({latest - before} backfills created)"
            )
        got = [r.logical_date.isoformat() if r.logical_date else None for r in runs]
        if got != fires:
            raise DemoFailure(f"backfill runs for {got}, expected one per fire time {fires}")
        return runs

    def step_backfill(self) -> int:
        """The first half of step 4: the backfill; return the requests it made."""
        week = self.plan.week
        start, end = fire_time(week[0]), fire_time(week[-1])
        self.section(
            4,
            f"A backfill of {week[0]} .. {week[-1]}, then the same range again",
            f"airflow backfill create --dag-id {DAG_ID} --from-date {start} --to-date {end}",
        )
        requests = self.requests()
        with self.console.status(f"backfill of {len(week)} dates ..."), self.timed("step 4a"):
            first = self.backfill("none")
        self.check(
            [r.state for r in first] == ["success"] * len(week),
            f"{len(first)} backfill runs, all success",
            self.run_failed([r.run_id for r in first]),
        )
        rows = []
        for run, day in zip(first, week, strict=True):
            s, export = self.date_state(day), self.details(day, "export_invoices")
            logical = f"{run.logical_date:%Y-%m-%d %H:%M}" if run.logical_date else "-"
            sent = export.get("exports_sent")
            rows.append((day, logical, run.state, s["orders"], s["invoices"], sent, s["remote"]))
        self.table(
            "First pass",
            ["business date", "logical date", "run", "orders", "invoices", "sent", "remote"],
            rows,
        )
        for day in week:
            ok, detail = self.converged(day)
            if not ok:
                self.check(False, "every date converged", detail)
        self.check(True, "every date: one invoice and one remote invoice per order")
        return self.requests() - requests

    def step_backfill_again(self, first_requests: int) -> None:
        """The second half of step 4: the same range, all no-ops (``first_requests``: what the
        first pass sent)."""
        week = self.plan.week
        before, requests, marker = self.fingerprint(week), self.requests(), self.last_attempt_id()
        self.say("The same range again, with [bold]--reprocess-behavior completed[/]:")
        status = self.console.status("the same backfill, --reprocess-behavior completed ...")
        with status, self.timed("step 4b"):
            second = self.backfill("completed")
        self.check(
            [r.state for r in second] == ["success"] * len(week)
            and all(r.clear_number > 0 for r in second),
            f"the {len(second)} completed runs were cleared and ran again, all success",
            self.run_failed([r.run_id for r in second]),
        )
        attempts = self.attempts(week, marker)
        by_job: dict[str, dict[str, int]] = {}
        for a in attempts:
            by_job.setdefault(a.job, {}).setdefault(a.outcome, 0)
            by_job[a.job][a.outcome] += 1
        self.table(
            "Second pass: attempts by job",
            ["job", "noop", "completed", "other"],
            [
                (
                    job,
                    by_job.get(job, {}).get("noop", 0),
                    by_job.get(job, {}).get("completed", 0),
                    sum(
                        n for k, n in by_job.get(job, {}).items() if k not in ("noop", "completed")
                    ),
                )
                for job in JOBS
            ],
        )
        covered = {(a.job, a.run_key) for a in attempts}
        self.check(
            {a.outcome for a in attempts} == {"noop"}
            and {a.triggered_by for a in attempts} == {"backfill"}
            and covered == {(j, d.isoformat()) for j in JOBS for d in week},
            f"all {len(attempts)} attempts of the second pass are no-ops (every job, every date)",
            str(attempts),
        )
        sent = self.requests() - requests
        self.check(
            sent == 0,
            f"0 requests to the accounting service (the first pass made {first_requests:,})",
            f"{sent} requests",
        )
        self.check(self.fingerprint(week) == before, "nothing rewritten in the job database")

    def step_crash(self) -> dict[str, int]:
        """The first half of step 5: the crash; return the state it left."""
        day, at, n = CRASH_DATE, self.plan.crash_at, self.plan.crash_orders
        point = f"ledger.after_remote_commit@{at}"
        self.section(
            5,
            f"A worker killed in the middle of the export of {day}, then the rerun",
            f"`airflow dags test` of the nightly run with AIRFLOW_IDEMPOTENCY_CRASH_AT={point}: "
            f"SIGKILL right after the accounting service committed invoice #{at}, before the "
            "ledger recorded it. The ledger claims (pending) and confirms invoices 50 at a "
            "time, 16 calls in flight.",
        )
        with self.console.status("the worker runs until it is killed ..."), self.timed("step 5a"):
            worker = self.start_dags_test(
                "crash",
                logical_date=fire_time(day),
                extra_env={"AIRFLOW_IDEMPOTENCY_CRASH_AT": point},
            )
            code = worker.wait(600)
            worker.kill()  # whatever it had started dies with it
        self.check(
            f"fault point {point}: SIGKILL" in worker.text(),
            f"the worker was SIGKILLed at {point} (exit {code}, log {rel(worker.log)})",
            f"no SIGKILL in {rel(worker.log)}; exit {code}",
        )
        middle = self.date_state(day)
        claimed = middle["ledger_succeeded"] + middle["ledger_pending"] + middle["ledger_failed"]
        status = self.rows(
            "SELECT split_part(job_name, '.', 2), status FROM idempotency.job_runs"
            " WHERE run_key = %s ORDER BY job_name",
            (day.isoformat(),),
        )
        locks = self.value(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
            " WHERE l.locktype = 'advisory' AND d.datname = current_database()"
        )
        self.table(
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
        self.check(
            0 < middle["ledger_succeeded"] < middle["remote"] < n
            and middle["ledger_pending"] > 0
            and locks == 0,
            "the export stopped half-way: confirmed, pending and unsent invoices; no lock left",
            str(middle),
        )
        return middle

    def step_rerun_after_crash(self, middle: dict[str, int]) -> None:
        """The second half of step 5: the rerun takes over what the crash left (``middle``)."""
        day, n = CRASH_DATE, self.plan.crash_orders
        requests, replays = self.requests(), int(self.service.stats()["replays"])
        self.say(f"The rerun, by hand through Airflow: conf {{'run_key': '{day}'}}")
        with self.console.status("Airflow reruns the date ..."), self.timed("step 5b"):
            run = self.trigger(conf={"run_key": day.isoformat()})
        self.check(
            run.state == "success",
            f"Airflow run {run.run_id} finished: {run.state}",
            self.run_failed([run.run_id]),
        )
        export = self.details(day, "export_invoices")
        after = self.date_state(day)
        replayed = int(self.service.stats()["replays"]) - replays
        self.table(
            "The rerun (export_invoices took over the started run)",
            ["", "count"],
            [
                ("skipped: confirmed before the crash", export.get("exports_skipped_existing")),
                ("sent: pending and unclaimed, each with its SAME key", export.get("exports_sent")),
                ("  of which the service already had (replayed)", replayed),
                ("requests to the service", self.requests() - requests),
                ("invoices the accounting service has now", after["remote"]),
            ],
        )
        self.check(
            export.get("exports_skipped_existing") == middle["ledger_succeeded"]
            and export.get("exports_sent") == n - middle["ledger_succeeded"],
            f"the {middle['ledger_succeeded']} confirmed invoices were not sent again, "
            f"the other {n - middle['ledger_succeeded']} were",
            str(export),
        )
        lost = middle["remote"] - middle["ledger_succeeded"]
        self.check(
            replayed >= lost,
            f"the {lost} the service got before the crash were answered from its idempotency "
            "keys, not created again",
            f"replays {replayed}, expected at least {lost}",
        )
        ok, detail = self.converged(day)
        self.check(
            ok, f"{after['remote']:,} remote invoices for {n:,} orders: no duplicate", detail
        )

    def attempts_by_outcome(self) -> None:
        """Step 6's table of attempts by job and outcome, with a legend of the outcomes."""
        counts: dict[str, dict[str, int]] = {}
        for job, outcome, count in self.rows(
            "SELECT split_part(job_name, '.', 2), outcome, count(*)"
            " FROM idempotency.job_run_attempts GROUP BY 1, 2"
        ):
            counts.setdefault(job, {})[outcome] = count
        present = [o for o in OUTCOMES if any(o in c for c in counts.values())]
        present += sorted({o for c in counts.values() for o in c} - set(present))
        self.table(
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
                self.say(f"[dim]{text}[/dim]")

    def step_summary(self) -> None:
        self.section(6, "Final state")
        job_runs = self.rows(
            "SELECT split_part(job_name, '.', 2), status, count(*), min(run_key), max(run_key)"
            " FROM idempotency.job_runs GROUP BY 1, 2 ORDER BY 1, 2"
        )
        self.table(
            "job_runs (one row per job and business date)",
            ["job", "status", "run keys", "from", "to"],
            job_runs,
        )
        self.attempts_by_outcome()
        ledger = self.rows(
            "SELECT status, count(*), sum(call_count) FROM idempotency.outbound_ledger"
            " WHERE remote_system = 'accounting' GROUP BY 1 ORDER BY 1"
        )
        self.table("outbound ledger: the export", ["status", "effects", "calls"], ledger)
        others = self.rows(
            "SELECT effect_kind, remote_system, status, count(*), sum(call_count)"
            " FROM idempotency.outbound_ledger WHERE remote_system <> 'accounting'"
            " GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
        )
        self.table(
            "outbound ledger: emails and files", ["kind", "remote", "status", "effects", "calls"],
            others,
        )  # fmt: skip
        orders = int(self.value("SELECT count(*) FROM orders"))
        invoices = int(self.value("SELECT count(*) FROM invoices"))
        stats = self.service.stats()
        duplicates = self.rows(
            "SELECT invoice->>'order_id', count(*) FROM accounting.invoices"
            " GROUP BY 1 HAVING count(*) > 1"
        )
        unknown = self.value(
            "SELECT count(*) FROM accounting.invoices a WHERE NOT EXISTS"
            " (SELECT FROM orders o WHERE o.order_id::text = a.invoice->>'order_id')"
        )
        self.table(
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
        expected_runs = len(JOBS) * len(self.plan.all_dates)
        self.check(
            [(j, s) for j, s, *_ in job_runs] == [(j, "completed") for j in sorted(JOBS)]
            and sum(r[2] for r in job_runs) == expected_runs,
            f"{expected_runs} job runs ({len(JOBS)} jobs x {len(self.plan.all_dates)} dates),"
            " all completed",
            str(job_runs),
        )
        self.check(
            [r[0] for r in ledger] == ["succeeded"] and ledger[0][1] == orders,
            f"{orders:,} ledger rows, all succeeded",
            str(ledger),
        )
        self.check(
            orders == invoices == stats["invoices"] == self.plan.total_orders,
            f"{orders:,} orders = {invoices:,} invoices = {stats['invoices']:,} remote invoices",
        )
        self.check(
            not duplicates and unknown == 0,
            "no duplicates: exactly one remote invoice per order",
            str(duplicates[:10]),
        )
        dates = self.plan.all_dates
        mails = [self.summary_mails(d) for d in dates]
        files = [self.export_file(d) is not None for d in dates]
        self.check(
            mails == [1] * len(dates) and len(self.smtp.deliveries()) == len(dates) and all(files),
            f"{len(dates)} finance summary emails, one per date, none twice; "
            f"{len(dates)} export files",
            f"emails per date {mails}, files {files}",
        )

    # ---------------------------------------------------------------- the whole demo

    def run(self) -> None:
        from devtools.airflow_stack import airflow_stack

        started = time.monotonic()
        with contextlib.ExitStack() as resources:
            try:
                self.console.rule(
                    "[bold]Idempotent nightly batch jobs: a guided demo", style="bold"
                )
                self.say(f"work folder {rel(self.workdir)}/ (Airflow home, logs; wiped at start)")
                with self.timed("set-up"):
                    self.setup_database(resources)
                    self.say(f"PostgreSQL: {self.server_note}, database [bold]{self.db_name}[/]")
                    self.start_service(resources)
                    self.say(f"accounting service: {self.service.url} (pid {self.service.pid})")
                    resources.callback(self.kill_workers)
                    self.seed()
                home = self.workdir / "airflow"
                self.say(
                    "starting Airflow: api-server, scheduler, dag-processor "
                    f"[dim](logs in {rel(home / 'stack-logs')}/)[/dim]"
                )
                airflow = contextlib.ExitStack()
                resources.callback(airflow.close)
                with self.console.status("Airflow is starting ..."), self.timed("Airflow start"):
                    self.stack = airflow.enter_context(
                        airflow_stack(home, DAGS_FOLDER, self.conn_env, start_timeout=300)
                    )
                    self.stack.unpause(DAG_ID, timeout=300)
                self.say(
                    f"Airflow answers on {self.stack.base_url} after "
                    f"{self.timings['Airflow start']:.0f} s; {DAG_ID} unpaused"
                )
                self.step_nightly_run()
                self.step_manual_rerun()
                self.step_two_at_once()
                self.step_backfill_again(self.step_backfill())
                self.step_rerun_after_crash(self.step_crash())
                with shielded(), self.timed("Airflow stop"):
                    airflow.close()
                self.step_summary()
            finally:
                cleaning_begins()
        self.timings["total"] = time.monotonic() - started


def _lines(exported: tuple[int, int, bytes] | None) -> int:
    """Lines of an export file (header included); 0 when there is none."""
    return exported[2].count(b"\n") if exported else 0


def _pair(details: dict[str, Any], a: str, b: str) -> str:
    return f"{details.get(a, '-')} / {details.get(b, '-')}"


# -- entry point ----------------------------------------------------------------------


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


def next_steps(demo: Demo, console: Console) -> None:
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
    demo = Demo(args, console, workdir, plan=Plan.build(args.quick, args.orders))
    failure: str | None = None
    try:
        demo.run()
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


if __name__ == "__main__":
    raise SystemExit(main())
