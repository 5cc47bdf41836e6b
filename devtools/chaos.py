"""Chaos: seeded, overlapping actions and faults against the real stack, checked against invariants.

``python3 dev.py chaos [--seed N] [--steps N] [--minutes M] [--broken skip-confirmed]``

What runs: a PRIVATE embedded PostgreSQL (the job database; private so that it can be
restarted), the example accounting service on it, and a real Airflow 3 stack (scheduler,
dag-processor, api-server) with the example DAGs of ``dags/``: ``finalize_invoices`` and
the pasted-twice pair ``daily_reconciliation`` / ``daily_reconciliation_pasted_twice``.

Each step draws from the seed one action over a few business dates (a window of
``--dates`` that moves on by one date every ``--new-date-every`` steps, so that first-time
work keeps happening under the faults), and independently
(with probability ``--fault-rate``) one fault. An action runs in its own thread and the next
step starts after a short random pause, so actions overlap (at most ``--overlap`` at once).

Actions: ``scheduled`` (a run at the exact fire time, as the scheduler creates it: the
REST API with that logical date), ``manual_key`` (the UI's Trigger with ``run_key``),
``manual_date`` (a logical date, no run_key), ``backfill`` (REST ``POST /backfills`` of a
range, reprocess none or completed), ``clear_run``, ``clear_task`` (with downstream),
``force``, ``dry_run``, ``force_reconcile``, ``pasted_twice`` (both reconciliation DAGs
at the same instant).

Faults: ``crash`` (a crash point armed in AIRFLOW_IDEMPOTENCY_FAULT_DIR: the next worker
process that reaches it SIGKILLs itself), ``terminate_lock`` (pg_terminate_backend of a
session holding a run lock), ``remote_5xx``, ``remote_reset``, ``remote_timeout``
(commit then no answer), ``remote_latency`` (the accounting service's fault injection,
for some seconds), ``service_kill`` (the accounting service SIGKILLed, restarted on the
same port after a few seconds), ``pg_restart`` (the job database stopped fast or
immediate, started again).

Every ``--check-every`` steps the runner waits for quiescence (all actions done, no DAG
run active) and checks the invariants; at the end it disarms every fault, reruns every
touched date until all its jobs are completed (convergence) and checks them all again.
A violation prints the seed, the step, the action log and the offending rows, and the
command exits 1. ``--seed N`` replays the same sequence of actions and faults (their
timing, and so the interleaving, depends on the machine).

``--broken skip-confirmed`` runs the stack against a patched COPY of the provider (in the
work folder, first on the stack's PYTHONPATH) whose ledger no longer skips confirmed keys:
the demonstration that the invariants catch a real regression. The switch exists only in
this developer tool; nothing in the provider reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import psycopg

from devtools import airflow_env
from devtools.airflow_env import DAGS_FOLDER, ROOT

FINALIZE = "finalize_invoices"
RECONCILE_DAGS = ("daily_reconciliation", "daily_reconciliation_pasted_twice")
FINALIZE_TASKS = ("create_invoices", "rebuild_totals", "export_invoices", "reconcile_export")
# The jobs every touched date must have completed after convergence. reconcile_export runs
# only with force_reconcile (and then always forced), so it is not one of them.
JOBS = (*(f"{FINALIZE}.{t}" for t in FINALIZE_TASKS[:3]), "daily_reconciliation")
RECONCILE_JOB = f"{FINALIZE}.{FINALIZE_TASKS[3]}"
FIRST_DATE = dt.date(2026, 10, 1)

ACTIONS: dict[str, int] = {  # kind -> weight
    "scheduled": 3,
    "manual_key": 3,
    "manual_date": 2,
    "backfill": 2,
    "clear_run": 2,
    "clear_task": 2,
    "force": 2,
    "dry_run": 1,
    "force_reconcile": 1,
    "pasted_twice": 1,
}
FAULTS: dict[str, int] = {
    "crash": 5,
    "terminate_lock": 2,
    "remote_5xx": 1,
    "remote_reset": 1,
    "remote_timeout": 1,
    "remote_latency": 1,
    "service_kill": 1,
    "pg_restart": 1,
}
CRASH_POINTS = (
    "runner.after_lock",
    "runner.after_started",
    "runner.before_completion",
    "ledger.after_claim",
    "ledger.before_remote_call",
    "ledger.after_remote_commit",
    "ledger.before_record_outcomes",
    "invoices.before_commit",
    "invoices.after_commit",
    "totals.after_delete",
)
BROKEN: dict[str, list[tuple[str, str, str]]] = {
    # The ledger no longer skips confirmed keys: its claim statement returns them too, and
    # the Python safety net that would still skip them is gone. (file, old text, new text)
    "skip-confirmed": [
        (
            "sql/queries.sql",
            "WHERE k.status IS DISTINCT FROM 'succeeded'\n   OR k.stored_fingerprint <> "
            "k.request_fingerprint;",
            "WHERE true;",
        ),
        (
            "ledger.py",
            'elif status == "succeeded":\n                summary.skipped_existing += 1',
            "elif False:\n                summary.skipped_existing += 1",
        ),
    ],
}
TERMINAL = frozenset({"success", "failed"})


def fire_time(day: dt.date, at: str = "01:00:00") -> str:
    """The logical date of the scheduled run that processes business date ``day``."""
    return f"{day + dt.timedelta(days=1)}T{at}+00:00"


def say(text: str) -> None:
    print(f"[chaos {dt.datetime.now(dt.timezone.utc):%H:%M:%S}] {text}", flush=True)


# ------------------------------------------------------------------------- the job database


class PrivateServer:
    """An embedded PostgreSQL owned by this run: a DSN, and restarts of that very server."""

    def __init__(self, data_dir: Path) -> None:
        from devtools.postgres import start_embedded

        self.server = start_embedded(data_dir)
        self.name = self.server.create_database("chaos")
        self.dsn = self.server.dsn(self.name)

    def restart(self, mode: str, down_seconds: float) -> None:
        from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

        handle = self.server._handle
        pg_ctl(["-w", "-m", mode, "stop"], pgdata=handle.pgdata, user=handle.system_user)
        time.sleep(down_seconds)
        with handle._lock:  # the same options and socket directory: the DSN stays valid
            handle.ensure_postgres_running()

    def stop(self) -> None:
        self.server.stop()


# ------------------------------------------------------------------------- the action log


@dataclass
class Event:
    step: int
    kind: str  # action or fault kind
    what: str
    began: float
    ended: float | None = None
    result: str = ""
    run_ids: list[tuple[str, str]] = field(default_factory=list)  # (dag_id, run_id)

    def line(self, t0: float) -> str:
        end = f"{self.ended - t0:7.1f}" if self.ended is not None else "      -"
        began = f"{self.began - t0:7.1f}"
        return (
            f"step {self.step:4d} {began}..{end} s  {self.kind:<15} {self.what}  -> {self.result}"
        )


@dataclass
class Violation:
    invariant: str
    detail: str
    rows: list[Any]

    def text(self) -> str:
        shown = "\n".join(f"      {r}" for r in self.rows[:20])
        more = f"\n      ... {len(self.rows) - 20} more" if len(self.rows) > 20 else ""
        return f"  VIOLATED {self.invariant}: {self.detail}\n{shown}{more}"


class ChaosFailure(RuntimeError):
    """An invariant broke (the report is printed before)."""


# ------------------------------------------------------------------------- the runner


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seed: int = args.seed
        self.rng = random.Random(self.seed)
        self.workdir: Path = args.workdir.resolve()
        # A window of --dates business dates moves on by one date every --new-date-every
        # steps: every date gets first-time work (its first export) under the faults, not
        # only the first few minutes of a long run.
        count = args.dates + (args.steps // args.new_date_every if args.new_date_every else 0)
        self.dates = [FIRST_DATE + dt.timedelta(days=i) for i in range(count)]
        self.events: list[Event] = []
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.touched: set[dt.date] = set()
        self.actions_by_kind: Counter[str] = Counter()
        self.faults_by_kind: Counter[str] = Counter()
        self.fault_results: Counter[str] = Counter()
        self.checks: Counter[str] = Counter()
        self.confirmed: dict[str, int] = {}  # ledger key -> call_count, when last seen succeeded
        self.steps_done = 0
        self.quiescent_points = 0
        self.service: Any = None
        self.service_port = 0
        self.service_lock = threading.Lock()
        self.fault_timers: list[threading.Timer] = []
        self.violations: list[Violation] = []
        self.revive_lock = threading.Lock()
        self.revived: Counter[str] = Counter()

    # ---------------------------------------------------------------- small helpers

    def log(self, event: Event) -> Event:
        with self.lock:
            self.events.append(event)
        return event

    def rows(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, connect_timeout=10) as conn:
            return conn.execute(sql, params).fetchall()

    def db_rows(self, sql: str, params: Any = None, attempts: int = 30) -> list[tuple[Any, ...]]:
        """:meth:`rows`, again while the database is restarting."""
        for attempt in range(attempts):
            try:
                return self.rows(sql, params)
            except psycopg.OperationalError:
                if attempt == attempts - 1:
                    raise
                time.sleep(1)
        return []

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """The REST API, again on a 5xx (SQLite's "database is locked" comes back as one)."""
        from devtools.airflow_stack import StackError

        for attempt in range(1, 7):
            try:
                return self.stack.api(method, path, body)
            except StackError as exc:
                if "-> 5" not in str(exc) or attempt == 6:
                    raise
                time.sleep(attempt)
        return None

    # ---------------------------------------------------------------- set-up

    def broken_pythonpath(self) -> str | None:
        """A patched copy of the provider for ``--broken``; its folder, for PYTHONPATH."""
        if not self.args.broken:
            return None
        target = self.workdir / "broken"
        shutil.rmtree(target, ignore_errors=True)
        package = target / "airflow_idempotency"
        shutil.copytree(ROOT / "provider" / "airflow_idempotency", package)
        for name, old, new in BROKEN[self.args.broken]:
            text = (package / name).read_text(encoding="utf-8")
            if old not in text:
                raise SystemExit(f"--broken {self.args.broken}: {name} has no {old!r} to patch")
            (package / name).write_text(text.replace(old, new, 1), encoding="utf-8")
        say(f"BROKEN BUILD: {self.args.broken} (patched copy in {target})")
        return str(target)

    def check_broken_is_used(self, folder: str) -> None:
        """The stack's processes import the patched copy, not this checkout's provider."""
        import subprocess

        found = subprocess.run(
            [sys.executable, "-c", "import airflow_idempotency as p; print(p.__file__)"],
            env=self.stack.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not found.startswith(folder):
            raise SystemExit(f"--broken: the stack would import {found}, not the copy in {folder}")

    def start_service(self) -> None:
        from devtools.accounting import run_accounting_service

        with self.service_lock:
            cm = run_accounting_service(self.dsn, port=self.service_port or None)
            service = cm.__enter__()
            self.service, self.service_cm = service, cm
            self.service_port = urlsplit(service.url).port or 0

    def stop_service(self, kill: bool = False) -> None:
        with self.service_lock:
            if self.service is None:
                return
            if kill:
                self.service.kill()
            with contextlib.suppress(Exception):
                self.service_cm.__exit__(None, None, None)
            self.service = None

    def ensure_service(self) -> None:
        """The service answers; restarted (same port) if it died (e.g. with the database)."""
        from devtools.accounting import AccountingServiceError

        with contextlib.suppress(Exception):
            if self.service is not None and self.service.process.poll() is None:
                self.service.stats()
                return
        self.stop_service(kill=True)
        for attempt in range(10):
            try:
                self.start_service()
                return
            except AccountingServiceError:
                if attempt == 9:
                    raise
                time.sleep(1)

    def seed_orders(self) -> None:
        from invoicing.seed import seed_orders

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            seed_orders(conn, self.dates[0], self.dates[-1], self.args.orders, self.seed % 1000)

    # ---------------------------------------------------------------- actions

    def trigger(
        self, dag_id: str, logical_date: str | None, conf: dict[str, Any]
    ) -> tuple[str, str] | None:
        """POST a DAG run; None if Airflow refused it (e.g. that logical date exists)."""
        from devtools.airflow_stack import StackError

        body = {"logical_date": logical_date, "conf": conf}
        try:
            run = self.api("POST", f"/api/v2/dags/{dag_id}/dagRuns", body)
        except StackError as exc:
            if "-> 409" in str(exc) or "-> 400" in str(exc):
                return None
            raise
        return dag_id, str(run["dag_run_id"])

    def revive(self) -> None:
        """Start again a stack component that died (the scheduler dies now and then on
        SQLite's "database is locked" under this load): an infrastructure failure of the
        test stack, logged, not an invariant of the provider."""
        revivable = ("api-server", "scheduler", "dag-processor")
        with self.revive_lock:
            for name, proc in list(self.stack.procs.items()):
                if proc.poll() is None or name not in revivable:
                    continue
                self.log(Event(self.steps_done, "revive", name, time.monotonic()))
                say(f"airflow {name} exited ({proc.returncode}): starting it again")
                self.revived[name] += 1
                self.stack.start_component(name)

    def wait_runs(self, run_ids: list[tuple[str, str]], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            self.revive()
            states: list[str] = []
            for dag_id, run_id in run_ids:
                run = self.stack.dag_run(dag_id, run_id)
                states.append((run.state or "none") if run else "missing")
            if all(s in TERMINAL or s == "missing" for s in states):
                return ",".join(states) or "no runs"
            if time.monotonic() > deadline:
                return "timeout:" + ",".join(str(s) for s in states)
            time.sleep(1)

    def existing_runs(self, dag_id: str) -> list[tuple[str, str | None]]:
        return [
            (r["run_id"], r["state"])
            for r in self.stack.query(
                "SELECT run_id, state FROM dag_run WHERE dag_id = ? ORDER BY id", (dag_id,)
            )
        ]

    def window(self, step: int) -> list[dt.date]:
        """The business dates actions of ``step`` draw from."""
        start = step // self.args.new_date_every if self.args.new_date_every else 0
        start = min(start, len(self.dates) - self.args.dates)
        return self.dates[start : start + self.args.dates]

    def plan_action(self, step: int) -> tuple[str, dict[str, Any]]:
        """Draw the next action and its parameters from the seed (nothing is done yet)."""
        kind = self.rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        window = self.window(step)
        day = self.rng.choice(window)
        params: dict[str, Any] = {"day": day}
        if kind == "manual_date":
            params["at"] = f"{self.rng.randrange(1, 24):02d}:{self.rng.randrange(60):02d}:00"
        elif kind == "backfill":
            i = window.index(day)
            params["last"] = window[min(len(window) - 1, i + self.rng.randrange(3))]
            params["reprocess"] = self.rng.choice(["none", "completed"])
        elif kind in ("clear_run", "clear_task"):
            params["pick"] = self.rng.random()
            params["task"] = self.rng.choice(FINALIZE_TASKS[:3])
        return kind, params

    def do_action(self, event: Event, kind: str, p: dict[str, Any]) -> None:
        day: dt.date = p["day"]
        key = day.isoformat()
        runs: list[tuple[str, str] | None] = []
        if kind == "scheduled":
            runs.append(self.trigger(FINALIZE, fire_time(day), {}))
        elif kind == "manual_key":
            runs.append(self.trigger(FINALIZE, None, {"run_key": key}))
        elif kind == "manual_date":
            runs.append(self.trigger(FINALIZE, fire_time(day, p["at"]), {}))
        elif kind == "force":
            runs.append(self.trigger(FINALIZE, None, {"run_key": key, "force": True}))
        elif kind == "dry_run":
            runs.append(self.trigger(FINALIZE, None, {"run_key": key, "dry_run": True}))
        elif kind == "force_reconcile":
            runs.append(self.trigger(FINALIZE, None, {"run_key": key, "force_reconcile": True}))
        elif kind == "pasted_twice":
            at = fire_time(day, "01:30:00")
            runs += [self.trigger(d, at, {}) for d in RECONCILE_DAGS]
        elif kind == "backfill":
            self.backfill(event, day, p["last"], p["reprocess"])
            return
        elif kind in ("clear_run", "clear_task"):
            self.clear(event, kind, p)
            return
        made = [r for r in runs if r is not None]
        event.run_ids = made
        refused = len(runs) - len(made)
        result = self.wait_runs(made, self.args.action_timeout) if made else ""
        event.result = result + (f" ({refused} refused by Airflow)" if refused else "")

    def backfill(self, event: Event, first: dt.date, last: dt.date, reprocess: str) -> None:
        from devtools.airflow_stack import StackError

        body = {
            "dag_id": FINALIZE,
            "from_date": fire_time(first),
            "to_date": fire_time(last),
            "run_backwards": False,
            "dag_run_conf": {},
            "reprocess_behavior": reprocess,
            "max_active_runs": 2,
        }
        event.what += f" {first}..{last} reprocess={reprocess}"
        try:
            made = self.api("POST", "/api/v2/backfills", body)
        except StackError as exc:
            if "-> 409" in str(exc):
                event.result = "refused: another backfill is running"
                return
            raise
        backfill_id = int(made["id"])
        event.run_ids = [(FINALIZE, r.run_id) for r in self.stack.backfill_runs(backfill_id)]
        event.result = (
            self.wait_runs(event.run_ids, self.args.action_timeout) if event.run_ids else "no runs"
        )
        self.stack._mark_backfill_complete(backfill_id)

    def clear(self, event: Event, kind: str, p: dict[str, Any]) -> None:
        runs = [r for r, state in self.existing_runs(FINALIZE) if state in TERMINAL]
        if not runs:
            event.result = "nothing to clear"
            return
        run_id = runs[int(p["pick"] * len(runs))]
        quoted = quote(run_id, safe="")
        if kind == "clear_run":
            self.api("POST", f"/api/v2/dags/{FINALIZE}/dagRuns/{quoted}/clear", {"dry_run": False})
            event.what += f" {run_id}"
        else:
            body = {
                "dry_run": False,
                "dag_run_id": run_id,
                "task_ids": [p["task"]],
                "include_downstream": True,
                "only_failed": False,
                "reset_dag_runs": True,
            }
            self.api("POST", f"/api/v2/dags/{FINALIZE}/clearTaskInstances", body)
            event.what += f" {run_id} {p['task']}+downstream"
        event.run_ids = [(FINALIZE, run_id)]
        time.sleep(1)
        event.result = self.wait_runs(event.run_ids, self.args.action_timeout)

    def run_keys_of(self, event: Event) -> set[dt.date]:
        found = set()
        for dag_id, run_id in event.run_ids:
            for (key,) in self.db_rows(
                "SELECT DISTINCT run_key FROM idempotency.job_run_attempts"
                " WHERE dag_id = %s AND run_id = %s",
                (dag_id, run_id),
            ):
                with contextlib.suppress(ValueError):
                    found.add(dt.date.fromisoformat(key))
        return found

    def start_action(self, step: int) -> threading.Thread:
        kind, params = self.plan_action(step)
        self.actions_by_kind[kind] += 1
        self.touched.add(params["day"])
        if "last" in params:
            i, j = self.dates.index(params["day"]), self.dates.index(params["last"])
            self.touched.update(self.dates[i : j + 1])
        what = f"{params['day']}" if kind not in ("clear_run", "clear_task") else ""
        event = self.log(Event(step, kind, what, time.monotonic()))

        def body() -> None:
            try:
                self.do_action(event, kind, params)
            except Exception as exc:  # an action that could not be done is logged, not fatal
                event.result = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            finally:
                event.ended = time.monotonic()
                say(event.line(self.t0))
            with contextlib.suppress(Exception):
                self.touched.update(self.run_keys_of(event))

        thread = threading.Thread(target=body, name=f"action-{step}", daemon=True)
        thread.start()
        return thread

    # ---------------------------------------------------------------- faults

    def plan_fault(self) -> tuple[str, dict[str, Any]] | None:
        if self.rng.random() >= self.args.fault_rate:
            return None
        kind = self.rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
        params: dict[str, Any] = {"delay": self.rng.uniform(0, 4)}
        if kind == "crash":
            params["point"] = self.rng.choice(CRASH_POINTS)
        elif kind.startswith("remote_"):
            params["seconds"] = self.rng.uniform(5, 20)
        elif kind == "service_kill":
            params["down"] = self.rng.uniform(1, 6)
        elif kind == "pg_restart":
            params["mode"] = self.rng.choice(["fast", "immediate"])
            params["down"] = self.rng.uniform(1, 4)
        elif kind == "terminate_lock":
            params["pick"] = self.rng.random()
        return kind, params

    def start_fault(self, step: int) -> threading.Thread | None:
        planned = self.plan_fault()
        if planned is None:
            return None
        kind, params = planned
        self.faults_by_kind[kind] += 1
        event = self.log(Event(step, kind, "", time.monotonic()))

        def body() -> None:
            time.sleep(params["delay"])
            event.began = time.monotonic()
            try:
                event.result = self.do_fault(event, kind, params)
            except Exception as exc:
                event.result = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            finally:
                event.ended = time.monotonic()
                say(event.line(self.t0))
            self.fault_results[f"{kind}: {event.result.split(':')[0]}"] += 1

        thread = threading.Thread(target=body, name=f"fault-{step}", daemon=True)
        thread.start()
        return thread

    def do_fault(self, event: Event, kind: str, p: dict[str, Any]) -> str:
        if kind == "crash":
            event.what = p["point"]
            (self.fault_dir / p["point"]).touch()
            return "armed"
        if kind == "terminate_lock":
            # Run locks live only while a task runs: wait up to 15 s for one.
            deadline = time.monotonic() + 15
            while True:
                holders = self.db_rows(
                    "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted"
                    " AND l.database ="
                    " (SELECT oid FROM pg_database WHERE datname = current_database())"
                    " ORDER BY l.pid"
                )
                if holders or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if not holders:
                return "no lock held"
            pid = holders[int(p["pick"] * len(holders))][0]
            event.what = f"backend {pid}"
            self.db_rows("SELECT pg_terminate_backend(%s)", (pid,))
            return "terminated"
        if kind.startswith("remote_"):
            table: dict[str, dict[str, Any]] = {
                "remote_5xx": {"fail_rate": 0.3},
                "remote_reset": {"reset_rate": 0.2, "reset_phase": "after_commit"},
                "remote_timeout": {"timeout_after_commit_rate": 0.1, "hang_seconds": 5.0},
                "remote_latency": {"latency_ms": 300.0},
            }
            settings = table[kind]
            event.what = f"{settings} for {p['seconds']:.0f} s"
            with self.service_lock:
                if self.service is None:
                    return "service down"
                self.service.set_faults(**settings)
            timer = threading.Timer(p["seconds"], self.clear_remote_faults)
            timer.daemon = True
            timer.start()
            self.fault_timers.append(timer)
            return "set"
        if kind == "service_kill":
            event.what = f"down {p['down']:.1f} s"
            self.stop_service(kill=True)
            time.sleep(p["down"])
            self.ensure_service()
            return "restarted"
        if kind == "pg_restart":
            event.what = f"-m {p['mode']}, down {p['down']:.1f} s"
            self.pg.restart(p["mode"], p["down"])
            time.sleep(1)
            self.ensure_service()
            return "restarted"
        raise ValueError(kind)

    def clear_remote_faults(self) -> None:
        with self.service_lock, contextlib.suppress(Exception):
            if self.service is not None:
                self.service.set_faults(
                    fail_rate=0.0, reset_rate=0.0, timeout_after_commit_rate=0.0, latency_ms=0.0
                )

    def disarm(self) -> None:
        for timer in self.fault_timers:
            timer.cancel()
        self.fault_timers.clear()
        for armed in self.fault_dir.iterdir():
            if ".claimed-by-" not in armed.name:
                armed.unlink()
        self.ensure_service()
        self.clear_remote_faults()

    # ---------------------------------------------------------------- quiescence

    def quiesce(self, threads: list[threading.Thread]) -> None:
        for thread in threads:
            thread.join()
        threads.clear()
        deadline = time.monotonic() + self.args.action_timeout
        while time.monotonic() < deadline:
            self.revive()
            active = self.stack.query(
                "SELECT count(*) FROM dag_run WHERE state IN ('running', 'queued')"
            )[0][0]
            if not active:
                break
            time.sleep(1)
        self.quiescent_points += 1

    # ---------------------------------------------------------------- invariants

    def check(self, final: bool) -> list[Violation]:
        found: list[Violation] = []

        def expect(name: str, rows: list[Any], detail: str) -> None:
            self.checks[name] += 1
            if rows:
                found.append(Violation(name, detail, rows))

        keys = sorted(d.isoformat() for d in self.touched)
        status = {
            (job, key): st
            for job, key, st in self.db_rows(
                "SELECT job_name, run_key, status FROM idempotency.job_runs"
            )
        }

        def completed(job: str) -> list[str]:
            return [k for k in keys if status.get((f"{FINALIZE}.{job}", k)) == "completed"]

        # 1. Remote: exactly one invoice per order; a completed export is all confirmed.
        expect(
            "one remote invoice per order",
            self.db_rows(
                "SELECT invoice->>'order_id', count(*), array_agg(idempotency_key)"
                " FROM accounting.invoices GROUP BY 1 HAVING count(*) > 1"
            ),
            "orders with more than one invoice in the accounting service",
        )
        exported = completed("export_invoices")
        expect(
            "completed export: one remote invoice per order",
            self.db_rows(
                "SELECT o.shipped_on::text, o.order_id, count(r.id) FROM orders o"
                " LEFT JOIN accounting.invoices r ON r.invoice->>'order_id' = o.order_id::text"
                " WHERE o.shipped_on::text = ANY(%s) GROUP BY 1, 2 HAVING count(r.id) <> 1",
                (exported,),
            ),
            "orders of a date whose export_invoices is completed, without exactly one remote"
            " invoice",
        )
        expect(
            "completed export: every ledger row succeeded",
            self.db_rows(
                "SELECT run_key, idempotency_key, status, last_error"
                " FROM idempotency.outbound_ledger"
                " WHERE run_key = ANY(%s) AND status <> 'succeeded'",
                (exported,),
            ),
            "ledger rows not succeeded on a date whose export_invoices is completed",
        )
        # 2. Internal writes: invoices = orders, totals = a fresh recomputation, one summary.
        expect(
            "completed create: invoices = orders",
            self.db_rows(
                "SELECT o.shipped_on::text, count(*) AS orders, count(i.order_id) AS invoices"
                " FROM orders o LEFT JOIN invoices i USING (order_id)"
                " WHERE o.shipped_on::text = ANY(%s) GROUP BY 1"
                " HAVING count(*) <> count(i.order_id) OR bool_or(o.invoiced_at IS NULL)",
                (completed("create_invoices"),),
            ),
            "dates whose create_invoices is completed with orders not invoiced",
        )
        expect(
            "completed totals = fresh recomputation",
            self.db_rows(
                "WITH fresh AS (SELECT business_date, store_id, count(*)::int AS n,"
                " sum(amount_cents)::bigint AS cents FROM invoices"
                " WHERE business_date::text = ANY(%(k)s) GROUP BY 1, 2),"
                " stored AS (SELECT business_date, store_id, invoice_count AS n,"
                " amount_cents AS cents FROM daily_invoice_totals"
                " WHERE business_date::text = ANY(%(k)s))"
                " SELECT 'stored' AS side, * FROM"
                " (SELECT * FROM stored EXCEPT SELECT * FROM fresh) a"
                " UNION ALL SELECT 'fresh', * FROM"
                " (SELECT * FROM fresh EXCEPT SELECT * FROM stored) b",
                {"k": completed("rebuild_totals")},
            ),
            "daily_invoice_totals rows that differ from a recomputation from the invoices",
        )
        expect(
            "one summary row per date",
            self.db_rows(
                "SELECT business_date, count(*) FROM reconciliation_summary GROUP BY 1"
                " HAVING count(*) > 1"
            ),
            "dates with more than one reconciliation summary",
        )
        # 3. A confirmed effect is never sent again: its call count never grows.
        now = {
            k: int(c)
            for k, c in self.db_rows(
                "SELECT idempotency_key, call_count FROM idempotency.outbound_ledger"
                " WHERE status = 'succeeded'"
            )
        }
        expect(
            "confirmed effect never sent again",
            [
                (k, f"call_count {c} when confirmed and checked, now {now.get(k)}")
                for k, c in sorted(self.confirmed.items())
                if now.get(k) != c
            ],
            "ledger keys confirmed at an earlier check that were called again since",
        )
        self.confirmed.update(now)
        # 4. Attempts tell a consistent story.
        attempts = self.db_rows(
            "SELECT job_name, run_key, attempt_id, outcome, force, dry_run, dag_id, run_id,"
            " task_id, try_number FROM idempotency.job_run_attempts"
            " ORDER BY job_name, run_key, attempt_id"
        )
        expect(
            "completed key never recomputed without force",
            recomputed_without_force(attempts),
            "a non-forced attempt did the work of a key already completed, with no unfinished"
            " forced recompute before it (job, key, attempt, previous completion)",
        )
        expect(
            "job_runs completed by a completed attempt",
            self.db_rows(
                "SELECT r.job_name, r.run_key, r.current_attempt_id, a.outcome"
                " FROM idempotency.job_runs r"
                " LEFT JOIN idempotency.job_run_attempts a ON a.attempt_id = r.current_attempt_id"
                " WHERE r.status = 'completed' AND a.outcome IS DISTINCT FROM 'completed'"
            ),
            "completed job_runs whose current attempt did not complete (e.g. lock_lost)",
        )
        expect(
            "every execution has its attempt row",
            self.executions_without_attempt(attempts),
            "successful task instances with no attempt row of a successful outcome"
            " (dag, run, task, try)",
        )
        expect(
            "no advisory lock left",
            self.db_rows(
                "SELECT l.pid, l.classid, l.objid, a.application_name, a.state"
                " FROM pg_locks l LEFT JOIN pg_stat_activity a USING (pid)"
                " WHERE l.locktype = 'advisory'"
                " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ),
            "advisory locks held while nothing runs",
        )
        if final:
            expect(
                "no running attempt without a live holder",
                self.db_rows(
                    "SELECT a.job_name, a.run_key, a.attempt_id, a.lock_backend_pid"
                    " FROM idempotency.job_run_attempts a WHERE a.outcome = 'running'"
                    " AND NOT EXISTS (SELECT 1 FROM pg_stat_activity s"
                    " WHERE s.pid = a.lock_backend_pid)"
                ),
                "attempts still running whose lock session is gone, after convergence",
            )
            expect(
                "converged: every job of every touched date completed",
                [
                    (job, key, status.get((job, key)))
                    for key in keys
                    for job in JOBS
                    if status.get((job, key)) != "completed"
                ],
                "job runs not completed after the convergence pass",
            )
        return found

    def executions_without_attempt(self, attempts: list[tuple[Any, ...]]) -> list[Any]:
        ok = {"completed", "noop", "dry_run"}
        seen = {(a[6], a[7], a[8], a[9]) for a in attempts if a[3] in ok}
        missing = []
        for r in self.stack.query(
            "SELECT dag_id, run_id, task_id, try_number FROM task_instance WHERE state = 'success'"
        ):
            if (r["dag_id"], r["run_id"], r["task_id"], r["try_number"]) not in seen:
                missing.append((r["dag_id"], r["run_id"], r["task_id"], r["try_number"]))
        return missing

    # ---------------------------------------------------------------- convergence

    def converge(self) -> None:
        say(f"convergence: rerunning {len(self.touched)} touched date(s) until completed")
        for round_ in range(1, 6):
            keys = sorted(self.touched)
            status = {
                (j, k): s
                for j, k, s in self.db_rows(
                    "SELECT job_name, run_key, status FROM idempotency.job_runs"
                )
            }
            todo = [
                d for d in keys if any(status.get((j, d.isoformat())) != "completed" for j in JOBS)
            ]
            # A forced reconcile that crashed left its key started (and its attempt running):
            # only another forced reconcile runs that job again, so convergence does one.
            reconcile = {
                d
                for d in keys
                if status.get((RECONCILE_JOB, d.isoformat())) not in (None, "completed")
            }
            todo = sorted(set(todo) | reconcile)
            if not todo:
                return
            runs = []
            for day in todo:
                event = self.log(
                    Event(self.steps_done, "converge", f"{day} round {round_}", time.monotonic())
                )
                conf: dict[str, Any] = {"run_key": day.isoformat()}
                if day in reconcile:
                    conf["force_reconcile"] = True
                made = [
                    self.trigger(FINALIZE, None, conf),
                    self.trigger(RECONCILE_DAGS[0], None, {"run_key": day.isoformat()}),
                ]
                event.run_ids = [m for m in made if m is not None]
                runs.append(event)
            for event in runs:
                event.result = self.wait_runs(event.run_ids, self.args.action_timeout)
                event.ended = time.monotonic()

    # ---------------------------------------------------------------- report

    def report(self, step: int, violations: list[Violation]) -> None:
        print("\n" + "=" * 100)
        print(
            f"CHAOS INVARIANT VIOLATION at step {step}: seed {self.seed} "
            f"(replay: python3 dev.py chaos --seed {self.seed} --steps {self.args.steps}"
            f"{' --broken ' + self.args.broken if self.args.broken else ''})"
        )
        for v in violations:
            print(v.text())
        print("action log:")
        with self.lock:
            for event in self.events:
                print("  " + event.line(self.t0))
        print("=" * 100, flush=True)

    def summary(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "steps": self.steps_done,
            "minutes": round((time.monotonic() - self.t0) / 60, 1),
            "dates": [d.isoformat() for d in sorted(self.touched)],
            "orders_per_date": self.args.orders,
            "broken": self.args.broken,
            "actions": dict(sorted(self.actions_by_kind.items())),
            "faults": dict(sorted(self.faults_by_kind.items())),
            "fault_results": dict(sorted(self.fault_results.items())),
            "quiescent_points": self.quiescent_points,
            "components_restarted": dict(self.revived),
            "crashes_claimed": sorted(
                p.name.split(".claimed-by-")[0]
                for p in self.fault_dir.iterdir()
                if ".claimed-by-" in p.name
            ),
            "invariant_checks": dict(sorted(self.checks.items())),
            "violations": [v.invariant for v in self.violations],
            "attempt_outcomes": dict(
                self.db_rows(
                    "SELECT outcome, count(*) FROM idempotency.job_run_attempts"
                    " GROUP BY 1 ORDER BY 1"
                )
            ),
            # Summed over every instance of the service (it restarts), from its own tables.
            "remote": {
                **dict(
                    self.db_rows(
                        "SELECT name, sum(value)::bigint FROM accounting.request_counters"
                        " GROUP BY 1 ORDER BY 1"
                    )
                ),
                "invoices": self.db_rows("SELECT count(*) FROM accounting.invoices")[0][0],
            },
            "ledger_calls": dict(
                self.db_rows(
                    "SELECT status, sum(call_count)::bigint FROM idempotency.outbound_ledger"
                    " GROUP BY 1 ORDER BY 1"
                )
            ),
        }

    # ---------------------------------------------------------------- the whole run

    def verify(self, step: int, final: bool = False) -> None:
        violations = self.check(final)
        say(
            f"step {step}: invariants checked ({'final' if final else 'quiescent'}): "
            f"{'OK' if not violations else str(len(violations)) + ' VIOLATED'}"
        )
        if violations:
            self.violations += violations
            self.report(step, violations)
            raise ChaosFailure(", ".join(v.invariant for v in violations))

    final_summary: dict[str, Any] | None = None

    def summary_safe(self) -> dict[str, Any]:
        if self.final_summary is not None:
            return self.final_summary
        return {"seed": self.seed, "steps": self.steps_done, "note": "no summary (set-up failed)"}

    def run(self) -> None:
        from devtools.airflow_stack import AirflowStack

        if self.workdir.exists():
            shutil.rmtree(self.workdir)
        self.workdir.mkdir(parents=True)
        self.fault_dir = self.workdir / "faults"
        self.fault_dir.mkdir()
        say(
            f"seed {self.seed}, {self.args.steps} steps (at most {self.args.minutes} min), "
            f"dates {self.dates[0]}..{self.dates[-1]}, {self.args.orders} orders each; "
            f"work folder {self.workdir}"
        )
        broken = self.broken_pythonpath()
        self.pg = PrivateServer(self.workdir / "pg")
        self.dsn = self.pg.dsn
        try:
            self.seed_orders()
            self.start_service()
            url = urlsplit(self.service.url)
            options = {
                "timeout": 2,
                "backoff_initial": 0.05,
                "backoff_max": 0.5,
                "batch_size": 10,
                "unreachable_after": 10,
            }
            pythonpath = [
                p for p in (broken, str(ROOT), str(DAGS_FOLDER), os.environ.get("PYTHONPATH")) if p
            ]
            env = {
                "AIRFLOW_CONN_IDEMPOTENCY_DEFAULT": airflow_env.airflow_connection_json(self.dsn),
                "AIRFLOW_CONN_ACCOUNTING_API": json.dumps(
                    {"conn_type": "http", "host": url.hostname, "port": url.port, "extra": options}
                ),
                "AIRFLOW_IDEMPOTENCY_FAULT_DIR": str(self.fault_dir),
                "AIRFLOW__CORE__PARALLELISM": str(self.args.parallelism),
                "PYTHONPATH": os.pathsep.join(pythonpath),
            }
            metadata = contextlib.ExitStack()
            metadata_dsn = None
            if self.args.airflow_db == "postgres":
                # Airflow's metadata on the shared server, not the private one the faults
                # restart: the scheduler on SQLite died of "database is locked" in long runs.
                from devtools.postgres import find_server, temporary_database

                metadata_dsn = metadata.enter_context(
                    temporary_database(find_server(), "idem_chaos_airflow")
                )
            self.stack = AirflowStack(
                self.workdir / "airflow", DAGS_FOLDER, env, metadata_dsn=metadata_dsn
            )
            if broken:
                self.check_broken_is_used(broken)
            try:
                self.stack.start(300)
                for dag_id in (FINALIZE, *RECONCILE_DAGS):
                    self.stack.unpause(dag_id, timeout=300)
                say(f"stack up after {time.monotonic() - self.t0:.0f} s")
                self.loop()
            finally:
                for timer in self.fault_timers:
                    timer.cancel()
                with contextlib.suppress(Exception):
                    self.final_summary = self.summary()
                self.stack.stop()
                metadata.close()
        finally:
            self.stop_service()
            self.pg.stop()

    def loop(self) -> None:
        threads: list[threading.Thread] = []
        deadline = self.t0 + self.args.minutes * 60
        step = 0
        for step in range(1, self.args.steps + 1):
            threads = [t for t in threads if t.is_alive()]
            while len([t for t in threads if t.name.startswith("action")]) >= self.args.overlap:
                next(t for t in threads if t.name.startswith("action")).join(timeout=1)
                threads = [t for t in threads if t.is_alive()]
            threads.append(self.start_action(step))
            fault = self.start_fault(step)
            if fault is not None:
                threads.append(fault)
            self.steps_done = step
            time.sleep(self.rng.uniform(0.5, self.args.max_gap))
            if step % self.args.check_every == 0 or step == self.args.steps:
                self.quiesce(threads)
                self.verify(step)
            if time.monotonic() > deadline:
                say(f"time is up after step {step}")
                break
        self.quiesce(threads)
        self.disarm()
        self.converge()
        self.quiesce(threads)
        self.verify(step, final=True)


def recomputed_without_force(attempts: list[tuple[Any, ...]]) -> list[Any]:
    """Attempts that did the work of a completed key although nothing allowed it.

    Work attempts are those not ``noop``/``lock_held``/``reset`` and not dry runs. After a
    completion, the next work attempt must be forced, unless a forced recompute since that
    completion did not complete (it left the key ``started`` or ``failed``, and a plain run
    finishes it: documented in the README).
    """
    bad = []
    state: dict[tuple[str, str], tuple[int | None, bool]] = {}
    for job, key, attempt_id, outcome, force, dry_run, *_ in attempts:
        if outcome in ("noop", "lock_held", "reset") or dry_run:
            continue
        last_completion, forced_unfinished = state.get((job, key), (None, False))
        if last_completion is not None and not force and not forced_unfinished:
            bad.append((job, key, attempt_id, last_completion))
        if outcome == "completed":
            state[(job, key)] = (attempt_id, False)
        elif force:
            state[(job, key)] = (last_completion, True)
    return bad


CHAOS_BEGIN = "<!-- chaos:begin -->"
CHAOS_END = "<!-- chaos:end -->"


def render_markdown(summary: dict[str, Any], command: str) -> str:
    """The chaos section of FAULTS.md for one run's summary."""

    def counts(data: Any) -> str:
        return ", ".join(f"{k} {v}" for k, v in dict(data or {}).items()) or "none"

    violations = summary.get("violations") or []
    dates = list(summary.get("dates") or [])
    checks = dict(summary.get("invariant_checks") or {})
    lines = [
        CHAOS_BEGIN,
        "## Chaos (devtools/chaos.py)",
        "",
        "Seeded, overlapping actions and independent faults against the real Airflow 3 stack, "
        "a private PostgreSQL and the accounting service; the invariants are checked at "
        "every quiescent point and after a final convergence pass. Written by "
        "`python3 dev.py chaos --faults-md FAULTS.md` (kept when `python3 dev.py faults` "
        "rewrites the rest of this file).",
        "",
        f"- Command: `{command}`",
        f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{summary.get('minutes')} min; seed **{summary.get('seed')}**; "
        f"**{summary.get('steps')} steps**; {len(dates)} business dates touched"
        + (f" ({dates[0]} .. {dates[-1]})" if dates else "")
        + f", {summary.get('orders_per_date')} orders each"
        + (f"; BROKEN BUILD `{summary['broken']}`" if summary.get("broken") else ""),
        f"- Actions by kind: {counts(summary.get('actions'))}",
        f"- Faults by kind: {counts(summary.get('faults'))}",
        f"- Fault outcomes: {counts(summary.get('fault_results'))}",
        f"- Crash points claimed (a worker SIGKILLed there): "
        f"{len(summary.get('crashes_claimed') or [])} "
        f"({counts(Counter(summary.get('crashes_claimed') or []))})",
        f"- Attempts by outcome: {counts(summary.get('attempt_outcomes'))}",
        *(
            [f"- Accounting service (all its instances): {counts(summary['remote'])}"]
            if summary.get("remote")
            else []
        ),
        f"- Quiescent points: {summary.get('quiescent_points')}; Airflow components "
        f"restarted after they died: {counts(summary.get('components_restarted'))}",
        f"- Result: **{len(violations)} violation(s)**"
        + (f": {', '.join(violations)}" if violations else ""),
        "",
        "| invariant | times checked |",
        "|---|---:|",
        *(f"| {name} | {n} |" for name, n in checks.items()),
        "",
        CHAOS_END,
    ]
    return "\n".join(lines)


def write_faults_md(path: Path, section: str) -> None:
    """Replace (or append) the chaos section of ``path``."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if CHAOS_BEGIN in text and CHAOS_END in text:
        head, rest = text.split(CHAOS_BEGIN, 1)
        tail = rest.split(CHAOS_END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text, encoding="utf-8")


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed (printed)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--minutes", type=float, default=30.0, help="stop drawing steps after this")
    parser.add_argument(
        "--dates", type=int, default=4, help="business dates in play at once, from 2026-10-01"
    )
    parser.add_argument(
        "--new-date-every",
        type=int,
        default=10,
        help="steps after which the window of dates moves on by one date (0: never)",
    )
    parser.add_argument("--orders", type=int, default=30, help="orders per business date")
    parser.add_argument("--overlap", type=int, default=3, help="actions in flight at most")
    parser.add_argument("--max-gap", type=float, default=4.0, help="seconds between steps, at most")
    parser.add_argument(
        "--check-every", type=int, default=10, help="steps between quiescent checks"
    )
    parser.add_argument("--fault-rate", type=float, default=0.6, help="chance of a fault per step")
    parser.add_argument("--action-timeout", type=float, default=420.0)
    parser.add_argument(
        "--parallelism", type=int, default=4, help="task instances Airflow runs at once"
    )
    parser.add_argument(
        "--broken",
        choices=sorted(BROKEN),
        default=None,
        help="run against a deliberately broken copy of the provider",
    )
    parser.add_argument(
        "--airflow-db",
        choices=("postgres", "sqlite"),
        default="postgres",
        help="Airflow's metadata database: a temporary database on the PostgreSQL server "
        "the tests use (default), or SQLite in the work folder",
    )
    parser.add_argument("--workdir", type=Path, default=ROOT / ".chaos")
    parser.add_argument("--summary", type=Path, default=None, help="write the summary JSON here")
    parser.add_argument(
        "--faults-md", type=Path, default=None, help="write the summary into this FAULTS.md"
    )
    parser.add_argument(
        "--from-summary",
        type=Path,
        default=None,
        help="with --faults-md: render a summary JSON written earlier instead of running",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.dates < 1 or args.orders < 1 or args.overlap < 1:
        parser.error("--steps, --dates, --orders and --overlap must be at least 1")
    if args.new_date_every < 0 or args.check_every < 1:
        parser.error("--new-date-every must not be negative, --check-every at least 1")
    if args.from_summary:
        if not args.faults_md:
            parser.error("--from-summary needs --faults-md")
        saved = json.loads(args.from_summary.read_text(encoding="utf-8"))
        write_faults_md(args.faults_md, render_markdown(saved, saved.get("command", "")))
        return 0
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 10**6)
    # SIGTERM (a CI timeout, a test's clean-up) unwinds like Ctrl-C: the stack, the service
    # and the private server are stopped by the finally blocks, none is left behind.
    signal.signal(signal.SIGTERM, _terminate)
    chaos = Chaos(args)
    code = 0
    try:
        chaos.run()
    except ChaosFailure:
        code = 1
    summary = chaos.summary_safe()
    summary["command"] = "python3 dev.py chaos " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:])
    )
    print("chaos summary: " + json.dumps(summary, default=str), flush=True)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    if args.faults_md:
        write_faults_md(args.faults_md, render_markdown(summary, summary["command"]))
    return code


if __name__ == "__main__":
    sys.exit(main())
