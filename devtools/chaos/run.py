"""Chaos: seeded, overlapping actions and faults against the real stack, checked against invariants.

``python3 dev.py chaos [--seed N] [--steps N] [--minutes M] [--builds correct,lock-off,...]``

What runs: a PRIVATE embedded PostgreSQL (the job database; private so that it can be
restarted), the example accounting service on it, and a real Airflow 3 stack (scheduler,
dag-processor, api-server) with the example DAGs of ``dags/``: ``finalize_invoices`` and
the pasted-twice pair ``daily_reconciliation`` / ``daily_reconciliation_pasted_twice``.

Builds and phases: ``--builds`` names the provider builds to run, one phase each, in turn
on ONE stack (devtools/chaos/builds.py): ``correct`` (this checkout's provider) and the
deliberately broken copies ``lock-off``, ``completed-check-off``, ``fence-off``,
``skip-confirmed``. Each phase gets a fresh job database (same name, so the same DSN), its
own business dates, a fresh accounting service on the same port, and a scheduler restarted
with the phase's PYTHONPATH and sleep points (its task processes import the phase's
provider). A correct build must keep every invariant; a broken one must be caught, and its
phase ends as soon as it is.

Each step draws from the seed one action over a few business dates (a window of
``--dates`` that moves on by one date every ``--new-date-every`` steps, so that first-time
work keeps happening under the faults), and independently (with probability
``--fault-rate``) one fault. An action runs in its own thread and the next step starts
after a short random pause, so actions overlap (at most ``--overlap`` at once). A broken
build's phase opens with the actions that expose it and uses its own weights.

Actions: ``scheduled`` (a run at the exact fire time, as the scheduler creates it: the
REST API with that logical date), ``manual_key`` (the UI's Trigger with ``run_key``),
``manual_date`` (a logical date, no run_key), ``backfill`` (REST ``POST /backfills`` of a
range, reprocess none or completed), ``clear_run``, ``clear_task`` (with downstream),
``force``, ``dry_run``, ``force_reconcile``, ``pasted_twice`` (both reconciliation DAGs
at the same instant).

Faults: ``crash`` (a crash point armed in AIRFLOW_IDEMPOTENCY_FAULT_DIR: the next worker
process that reaches it SIGKILLs itself), ``terminate_lock`` (pg_terminate_backend of a
session holding a run lock, found while a stall armed in the same folder holds one run at a
point for 3 s, often in its open work transaction; the database clock once that backend is
gone is recorded in ``witness_lock_losses``), ``remote_5xx``, ``remote_reset``,
``remote_timeout`` (commit then no answer), ``remote_latency`` (the accounting service's
fault injection, for some seconds), ``service_kill`` (the accounting service SIGKILLed,
restarted on the same port after a few seconds), ``pg_restart`` (the job database stopped
fast or immediate, started again).

Invariants (devtools/invariants.py): the history invariants (``always``: executions
counted by the witnesses) after every step; the end-state ones at every ``--check-every``
steps once quiescent (all actions done, no DAG run active); at the end of a correct phase
every fault is disarmed, ``--require-fired`` faults that did not fire are forced until they
do, every touched date is rerun until all its jobs completed (convergence) and everything is
checked again. A violation prints the seed, the step, the action log, the offending rows
and the history of their keys. ``--seed N`` replays the same sequence of actions and faults
(their timing, and so the interleaving, depends on the machine). The command exits 0 when
every phase ended as it must (correct: no violation; broken: caught), else 1.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import psycopg

from devtools import invariants
from devtools.airflow_env import DAGS_FOLDER, ROOT, connection_env
from devtools.chaos.builds import BROKEN, BUILDS, CORRECT, Build, patched_copy
from devtools.chaos.report import render_markdown, write_faults_md
from devtools.invariants import FINALIZE, RECONCILE_JOB, fire_time

RECONCILE_DAGS = ("daily_reconciliation", "daily_reconciliation_pasted_twice")
FINALIZE_TASKS = ("create_invoices", "rebuild_totals", "export_invoices", "reconcile_export")
RECONCILE_EXPORT_JOB = f"{FINALIZE}.{FINALIZE_TASKS[3]}"
# Jobs whose work transactions the example witnesses (work_witness).
WITNESSED_JOBS = (f"{FINALIZE}.create_invoices", f"{FINALIZE}.rebuild_totals", RECONCILE_JOB)
FIRST_DATE = dt.date(2026, 10, 1)
DATABASE = "chaos"
TERMINAL = frozenset({"success", "failed"})

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
# Where terminate_lock stalls one run (3 s) so that a lock session is there to end: in the
# open work transaction of a witnessed job, or (for any run) just after its attempt started.
STALL_SECONDS = 3
STALL_IN_WORK = ("invoices.before_commit", "totals.after_delete")
STALL_ANY = "runner.after_started"
# What --require-fired can ask for, and the fault that fires it.
PROOFS = {"crash": "crash", "terminate_lock": "terminate_lock", "restart": "pg_restart"}

_T = TypeVar("_T")


def say(text: str) -> None:
    print(f"[chaos {dt.datetime.now(dt.timezone.utc):%H:%M:%S}] {text}", flush=True)


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


class PhaseOver(Exception):
    """The phase ends now: an invariant broke (reported before)."""


@dataclass
class Phase:
    """One build's run: its dates, its log, what it did and what it found."""

    build: Build
    index: int
    seed: int
    dates: list[dt.date]
    window_size: int
    rng: random.Random
    t0: float = field(default_factory=time.monotonic)
    loop_t0: float = 0.0
    base_run_id: int = 0  # dag_run ids above this one are this phase's
    events: list[Event] = field(default_factory=list)
    touched: set[dt.date] = field(default_factory=set)
    actions: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    fault_results: Counter[str] = field(default_factory=Counter)
    checker: invariants.Checker = field(default_factory=invariants.Checker)
    violations: list[invariants.Violation] = field(default_factory=list)
    caught_at_step: int | None = None
    caught_after: float | None = None
    steps: int = 0
    quiescent_points: int = 0
    backfills: list[int] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return sorted(d.isoformat() for d in self.touched)

    @property
    def ok(self) -> bool:
        """A correct build kept every invariant; a broken one was caught by what must."""
        if not self.build.broken:
            return not self.violations and bool(self.summary.get("converged"))
        names = {v.invariant.name for v in self.violations}
        return bool(names & set(self.build.caught_by))


# ------------------------------------------------------------------------- the runner


class Chaos:
    """The stack, the job database and the service, shared by the phases."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seed: int = args.seed
        self.workdir: Path = args.workdir.resolve()
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.service: Any = None
        self.service_cm: Any = None
        self.service_port = 0
        self.service_lock = threading.Lock()
        self.fault_timers: list[threading.Timer] = []
        self.revive_lock = threading.Lock()
        self.revived: Counter[str] = Counter()
        self.phases: list[Phase] = []
        self.phase: Phase | None = None
        self.startup_seconds = 0.0
        self.dsn = ""

    # ---------------------------------------------------------------- small helpers

    @property
    def p(self) -> Phase:
        assert self.phase is not None
        return self.phase

    def log(self, event: Event) -> Event:
        with self.lock:
            self.p.events.append(event)
        return event

    def retrying(self, what: Callable[[], _T], attempts: int = 30) -> _T:
        """``what()``, again while the database is restarting."""
        for attempt in range(attempts):
            try:
                return what()
            except psycopg.OperationalError:
                if attempt == attempts - 1:
                    raise
                time.sleep(1)
        raise AssertionError("unreachable")

    def db_rows(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        def read() -> list[tuple[Any, ...]]:
            with psycopg.connect(self.dsn, connect_timeout=10) as conn:
                return conn.execute(sql, params).fetchall()

        return self.retrying(read)

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """The REST API, again on a 5xx."""
        from devtools.airflow_stack import StackError

        for attempt in range(1, 7):
            try:
                return self.stack.api(method, path, body)
            except StackError as exc:
                if "-> 5" not in str(exc) or attempt == 6:
                    raise
                time.sleep(attempt)
        return None

    # ---------------------------------------------------------------- the service

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

    # ---------------------------------------------------------------- set-up

    def run(self) -> None:
        """Every phase on one stack; the set-up and clean-up of what they share."""
        from devtools.postgres import find_server, private_embedded, temporary_database

        if self.workdir.exists():
            shutil.rmtree(self.workdir)
        self.workdir.mkdir(parents=True)
        self.fault_dir = self.workdir / "faults"
        self.fault_dir.mkdir()
        say(
            f"seed {self.seed}, builds {', '.join(self.args.builds)}; {self.args.steps} steps "
            f"a correct phase (at most {self.args.minutes} min), {self.args.broken_steps} a "
            f"broken one; work folder {self.workdir}"
        )
        with contextlib.ExitStack() as stack:
            self.pg = stack.enter_context(private_embedded("chaos"))
            self.pg.create_database(name=DATABASE)
            self.dsn = self.pg.dsn(DATABASE)
            metadata_dsn = None
            if self.args.airflow_db == "postgres":
                # Airflow's metadata on the shared server, not the private one the faults
                # restart: the scheduler on SQLite died of "database is locked" in long runs.
                metadata_dsn = stack.enter_context(
                    temporary_database(find_server(), "idem_chaos_airflow")
                )
            stack.callback(self.stop_service)
            first = BUILDS[self.args.builds[0]]
            self.phase = self.new_phase(first, 0)
            self.prepare_database()
            self.start_service()
            stack.callback(self.stop_stack)
            self.start_stack(first, metadata_dsn)
            self.startup_seconds = time.monotonic() - self.t0
            say(f"stack up after {self.startup_seconds:.0f} s")
            for index, name in enumerate(self.args.builds):
                if index:
                    self.phase = self.new_phase(BUILDS[name], index)
                    self.switch_to(self.p)
                self.phases.append(self.p)
                self.run_phase()

    def new_phase(self, build: Build, index: int) -> Phase:
        """The phase of ``build``: business dates after every earlier phase's (so that their
        Airflow runs never collide), and its seed."""
        dates = build.dates or self.args.dates
        first, last = phase_dates(self.args)[index]
        count = (last - first).days + 1
        # A broken build runs with its own fixed seed (chosen so that it is caught every
        # time), unless --broken-seed says otherwise; a correct one with --seed.
        seed = self.seed
        if build.broken:
            seed = self.args.broken_seed or build.seed
        elif index:
            seed = random.Random(f"{self.seed}:{index}").randrange(1, 10**6)
        return Phase(
            build=build,
            index=index,
            seed=seed,
            dates=[first + dt.timedelta(days=i) for i in range(count)],
            window_size=min(dates, count),
            rng=random.Random(seed),
        )

    def prepare_database(self) -> None:
        """The phase's job database: empty, with the example's orders of its dates."""
        from invoicing.seed import seed_orders

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            dates = self.p.dates
            seed_orders(conn, dates[0], dates[-1], self.args.orders, self.p.seed % 1000)
        invariants.prepare(self.dsn)

    def phase_env(self, build: Build) -> dict[str, str]:
        folder = None
        if build.broken:
            folder = str(patched_copy(build, self.workdir / "builds" / build.name))
            say(f"BROKEN BUILD: {build.name}: {build.what} (patched copy in {folder})")
        pythonpath = [
            p for p in (folder, str(ROOT), str(DAGS_FOLDER), os.environ.get("PYTHONPATH")) if p
        ]
        env = {"PYTHONPATH": os.pathsep.join(pythonpath)}
        if build.sleep_at:
            env["AIRFLOW_IDEMPOTENCY_SLEEP_AT"] = build.sleep_at
        return env

    def start_stack(self, build: Build, metadata_dsn: str | None) -> None:
        from devtools.airflow_stack import AirflowStack

        env = {
            **connection_env(self.dsn, self.service.url, batch_size=10, unreachable_after=10),
            "AIRFLOW_IDEMPOTENCY_FAULT_DIR": str(self.fault_dir),
            "AIRFLOW__CORE__PARALLELISM": str(self.args.parallelism),
            **self.phase_env(build),
        }
        self.stack = AirflowStack(
            self.workdir / "airflow", DAGS_FOLDER, env, metadata_dsn=metadata_dsn
        )
        self.check_build_is_used(build)
        self.stack.start(300)
        for dag_id in (FINALIZE, *RECONCILE_DAGS):
            self.stack.unpause(dag_id, timeout=300)

    def stop_stack(self) -> None:
        for timer in self.fault_timers:
            timer.cancel()
        if hasattr(self, "stack"):
            self.stack.stop()

    def check_build_is_used(self, build: Build) -> None:
        """The stack's processes import the phase's provider: the patched copy or this
        checkout's."""
        import subprocess

        found = subprocess.run(
            [sys.executable, "-c", "import airflow_idempotency as p; print(p.__file__)"],
            env=self.stack.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        wanted = self.workdir / "builds" / build.name if build.broken else ROOT / "provider"
        if not found.startswith(str(wanted)):
            raise SystemExit(f"build {build.name}: the stack would import {found}, not {wanted}")

    def switch_to(self, phase: Phase) -> None:
        """A fresh job database and service, and a scheduler that imports ``phase``'s build."""
        t0 = time.monotonic()
        self.stop_service()
        self.pg.drop_database(DATABASE)
        self.pg.create_database(name=DATABASE)
        for armed in self.fault_dir.iterdir():
            armed.unlink()
        self.prepare_database()
        self.start_service()
        for name in ("AIRFLOW_IDEMPOTENCY_SLEEP_AT", "PYTHONPATH"):
            self.stack.env.pop(name, None)
        self.stack.env.update(self.phase_env(phase.build))
        self.check_build_is_used(phase.build)
        self.stack.restart_component("scheduler")
        for dag_id in (FINALIZE, *RECONCILE_DAGS):
            self.stack.unpause(dag_id)
        say(f"phase {phase.build.name}: switched in {time.monotonic() - t0:.0f} s")

    def end_phase_now(self) -> None:
        """Stop what a phase ended by a violation still runs: no new tasks, its runs failed,
        its backfills done (the next phase's scheduler, restarted, starts on a clean slate)."""
        for dag_id in (FINALIZE, *RECONCILE_DAGS):
            with contextlib.suppress(Exception):
                self.stack.pause(dag_id)
        for row in self.stack.query(
            "SELECT dag_id, run_id FROM dag_run WHERE state IN ('running', 'queued') AND id > ?",
            (self.p.base_run_id,),
        ):
            with contextlib.suppress(Exception):
                quoted = quote(row["run_id"], safe="")
                self.api(
                    "PATCH", f"/api/v2/dags/{row['dag_id']}/dagRuns/{quoted}", {"state": "failed"}
                )
        for backfill_id in self.p.backfills:
            with contextlib.suppress(Exception):
                self.stack.mark_backfill_complete(backfill_id)

    # ---------------------------------------------------------------- one phase

    def run_phase(self) -> None:
        phase = self.p
        phase.t0 = time.monotonic()
        base = self.stack.query("SELECT coalesce(max(id), 0) FROM dag_run")[0][0]
        phase.base_run_id = int(base)
        say(
            f"phase {phase.index + 1}: build {phase.build.name}, seed {phase.seed}, dates "
            f"{phase.dates[0]}..{phase.dates[-1]}, {self.args.orders} orders each"
        )
        threads: list[threading.Thread] = []
        try:
            self.loop(threads)
            if not phase.build.broken:
                self.quiesce(threads)
                self.prove_faults(threads)
                self.disarm()
                self.converge()
                self.quiesce(threads)
                self.verify(("always", "quiescent", "converged"), final=True)
                phase.summary["converged"] = True
            else:
                say(f"phase {phase.build.name}: NOT caught in {phase.steps} steps")
        except PhaseOver:
            pass
        finally:
            if phase.caught_at_step is not None:
                self.end_phase_now()
            for thread in threads:  # the actions see their runs end; faults are short
                thread.join(timeout=120)
            self.disarm()
            with contextlib.suppress(Exception):
                phase.summary.update(self.summary())

    def loop(self, threads: list[threading.Thread]) -> None:
        phase = self.p
        broken = phase.build.broken
        steps = self.args.broken_steps if broken else self.args.steps
        phase.loop_t0 = time.monotonic()
        deadline = phase.loop_t0 + self.args.minutes * 60  # after start-up: steps only
        for step in range(1, steps + 1):
            threads[:] = [t for t in threads if t.is_alive()]
            while len([t for t in threads if t.name.startswith("action")]) >= self.args.overlap:
                next(t for t in threads if t.name.startswith("action")).join(timeout=1)
                threads[:] = [t for t in threads if t.is_alive()]
                self.verify(("always",))
            threads.append(self.start_action(step))
            fault = self.start_fault(step)
            if fault is not None:
                threads.append(fault)
            phase.steps = step
            self.pause(self.p.rng.uniform(0.5, self.args.max_gap))
            if step % self.args.check_every == 0 and not broken:
                self.quiesce(threads)
                self.verify(("always", "quiescent"))
            if time.monotonic() > deadline:
                say(f"time is up after step {step}")
                break
        if broken:
            # The runs it started finish; what they did is judged once more.
            self.quiesce(threads)
            self.verify(("always", "quiescent"))

    def pause(self, seconds: float) -> None:
        """Wait ``seconds``, checking the history invariants every second meanwhile."""
        end = time.monotonic() + seconds
        while True:
            self.verify(("always",))
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(1.0, left))

    # ---------------------------------------------------------------- actions

    def window(self, step: int) -> list[dt.date]:
        """The business dates actions of ``step`` draw from."""
        phase = self.p
        start = step // self.args.new_date_every if self.args.new_date_every else 0
        start = min(start, len(phase.dates) - phase.window_size)
        return phase.dates[start : start + phase.window_size]

    def plan_action(self, step: int, kind: str | None = None) -> tuple[str, dict[str, Any]]:
        """Draw the next action (unless ``kind`` is given) and its parameters from the seed
        (nothing is done yet); a phase opens with its build's opening actions."""
        phase = self.p
        weights = phase.build.actions or ACTIONS
        drawn = phase.rng.choices(list(weights), weights=list(weights.values()))[0]
        if kind is None:
            opening = phase.build.opening
            kind = opening[step - 1] if step <= len(opening) else drawn
        window = self.window(step)
        day = phase.rng.choice(window)
        params: dict[str, Any] = {"day": day}
        if kind == "manual_date":
            params["at"] = f"{phase.rng.randrange(1, 24):02d}:{phase.rng.randrange(60):02d}"
        elif kind == "backfill":
            i = window.index(day)
            params["last"] = window[min(len(window) - 1, i + phase.rng.randrange(3))]
            params["reprocess"] = phase.rng.choice(["none", "completed"])
        elif kind in ("clear_run", "clear_task"):
            params["pick"] = phase.rng.random()
            params["task"] = phase.rng.choice(FINALIZE_TASKS[:3])
        return kind, params

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
        """Start again a stack component that died (an infrastructure failure of the test
        stack, logged, not an invariant of the provider)."""
        revivable = ("api-server", "scheduler", "dag-processor")
        with self.revive_lock:
            for name, proc in list(self.stack.procs.items()):
                if proc.poll() is None or name not in revivable:
                    continue
                self.log(Event(self.p.steps, "revive", name, time.monotonic()))
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
            at = fire_time(day, "01:30")
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
        self.p.backfills.append(backfill_id)
        event.run_ids = [(FINALIZE, r.run_id) for r in self.stack.backfill_runs(backfill_id)]
        event.result = (
            self.wait_runs(event.run_ids, self.args.action_timeout) if event.run_ids else "no runs"
        )
        self.stack.mark_backfill_complete(backfill_id)

    def clear(self, event: Event, kind: str, p: dict[str, Any]) -> None:
        runs = [
            r["run_id"]
            for r in self.stack.query(
                "SELECT run_id, state FROM dag_run WHERE dag_id = ? AND id > ? ORDER BY id",
                (FINALIZE, self.p.base_run_id),
            )
            if r["state"] in TERMINAL
        ]
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

    def start_action(self, step: int, kind: str | None = None) -> threading.Thread:
        phase = self.p
        kind, params = self.plan_action(step, kind)
        phase.actions[kind] += 1
        phase.touched.add(params["day"])
        if "last" in params:
            i, j = phase.dates.index(params["day"]), phase.dates.index(params["last"])
            phase.touched.update(phase.dates[i : j + 1])
        what = f"{params['day']}" if kind not in ("clear_run", "clear_task") else ""
        event = self.log(Event(step, kind, what, time.monotonic()))

        def body() -> None:
            try:
                self.do_action(event, kind, params)
            except Exception as exc:  # an action that could not be done is logged, not fatal
                event.result = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            finally:
                event.ended = time.monotonic()
                say(event.line(phase.t0))
            with contextlib.suppress(Exception):
                phase.touched.update(self.run_keys_of(event))

        thread = threading.Thread(target=body, name=f"action-{step}", daemon=True)
        thread.start()
        return thread

    # ---------------------------------------------------------------- faults

    def plan_fault(self) -> tuple[str, dict[str, Any]] | None:
        phase = self.p
        rate = phase.build.fault_rate
        if phase.rng.random() >= (self.args.fault_rate if rate is None else rate):
            return None
        weights = phase.build.faults or FAULTS
        kind = phase.rng.choices(list(weights), weights=list(weights.values()))[0]
        return kind, self.fault_params(kind)

    def fault_params(self, kind: str) -> dict[str, Any]:
        rng = self.p.rng
        params: dict[str, Any] = {"delay": rng.uniform(0, 4)}
        if kind == "crash":
            params["point"] = rng.choice(CRASH_POINTS)
        elif kind.startswith("remote_"):
            params["seconds"] = rng.uniform(5, 20)
        elif kind == "service_kill":
            params["down"] = rng.uniform(1, 6)
        elif kind == "pg_restart":
            params["mode"] = rng.choice(["fast", "immediate"])
            params["down"] = rng.uniform(1, 4)
        elif kind == "terminate_lock":
            params["pick"] = rng.random()
            # Half of them (all in a phase that needs it) end the lock of a run whose work
            # is witnessed, so that what the work commits afterwards is seen.
            share = 1.0 if self.p.build.faults.get("terminate_lock") else 0.5
            params["work"] = rng.random() < share
            params["stall_at"] = rng.choice(STALL_IN_WORK) if params["work"] else STALL_ANY
        return params

    def start_fault(
        self, step: int, planned: tuple[str, dict[str, Any]] | None = None
    ) -> threading.Thread | None:
        planned = planned or self.plan_fault()
        if planned is None:
            return None
        phase = self.p
        kind, params = planned
        phase.faults[kind] += 1
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
                say(event.line(phase.t0))
            phase.fault_results[f"{kind}: {event.result.split(':')[0]}"] += 1

        thread = threading.Thread(target=body, name=f"fault-{step}", daemon=True)
        thread.start()
        return thread

    def do_fault(self, event: Event, kind: str, p: dict[str, Any]) -> str:
        if kind == "crash":
            event.what = p["point"]
            (self.fault_dir / p["point"]).touch()
            return "armed"
        if kind == "terminate_lock":
            return self.terminate_lock(event, p)
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

    def terminate_lock(self, event: Event, p: dict[str, Any]) -> str:
        """End a run lock's session; record when the database no longer had it.

        Run locks live only while a task runs, often for less than the time between two
        looks: a stall is armed (the next run to pass its point holds its lock there for
        STALL_SECONDS; inside its open work transaction when ``p["work"]``), and this waits
        up to 15 s for a lock (one whose attempt does witnessed work, when ``p["work"]``).
        """
        stall = None  # a caller that holds its own run's lock open passes no stall_at
        if p.get("stall_at"):
            stall = self.fault_dir / f"{p['stall_at']}.stall"
            staging = self.fault_dir / f"staging-{event.step}-{p['stall_at']}"
            staging.write_text(str(STALL_SECONDS))
            staging.replace(stall)  # a worker never reads a half-written file
        deadline = time.monotonic() + 15
        try:
            while True:
                sessions = self.retrying(lambda: invariants.run_lock_sessions(self.dsn))
                working = [s for s in sessions if s["job_name"] in WITNESSED_JOBS]
                candidates = working if p["work"] else sessions
                if candidates or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            if stall is not None:
                stall.unlink(missing_ok=True)  # not claimed by then: disarmed
        candidates = candidates or sessions
        if not candidates:
            return "no lock held"
        victim = candidates[int(p["pick"] * len(candidates))]
        event.what = f"backend {victim['pid']} ({victim['job_name'] or 'no attempt yet'})"
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=10) as conn:
            terminated_at = conn.execute(
                "SELECT clock_timestamp() FROM pg_terminate_backend(%s)", (victim["pid"],)
            ).fetchone()
            gone: dict[str, Any] = {"gone": False, "seen_at": None}
            which = {"pid": victim["pid"], "backend_start": victim["backend_start"]}
            for _ in range(500):  # the backend goes within milliseconds; 10 s at most
                gone = invariants.dict_rows(conn, "backend_gone", which)[0]
                if gone["gone"]:
                    break
                time.sleep(0.02)
            if not gone["gone"]:
                return "terminated: backend still there after 10 s (not recorded)"
            loss = {
                **which,
                "lock_key": victim["lock_key"],
                "terminated_at": terminated_at[0] if terminated_at else gone["seen_at"],
                "gone_at": gone["seen_at"],
            }
            conn.execute(invariants.queries()["record_lock_loss"], loss)
        return "terminated"

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

    def crashes_claimed(self) -> list[str]:
        """The crash points a worker claimed (stalls armed by terminate_lock are not crashes)."""
        return sorted(
            point
            for point, claimed, _ in (
                p.name.partition(".claimed-by-") for p in self.fault_dir.iterdir()
            )
            if claimed and not point.endswith(".stall")
        )

    def fired(self) -> dict[str, int]:
        """Faults that really happened: crash points claimed by a worker, lock sessions
        ended, restarts (the database or the service)."""
        results = self.p.fault_results
        return {
            "crash": len(self.crashes_claimed()),
            "terminate_lock": results["terminate_lock: terminated"],
            "restart": results["pg_restart: restarted"] + results["service_kill: restarted"],
        }

    def prove_faults(self, threads: list[threading.Thread]) -> None:
        """Fire each --require-fired fault that the seeded steps did not: a forced rerun of
        a date (its work holds locks, passes every crash point) with that fault, again
        until it fired (at most 5 times)."""
        for wanted in self.args.require_fired:
            for _ in range(5):
                if self.fired()[wanted]:
                    break
                step = self.p.steps + 1
                self.p.steps = step
                kind = PROOFS[wanted]
                params = self.fault_params(kind)
                if kind == "crash":
                    params["point"] = "runner.after_lock"  # every run passes it
                params["delay"] = 1.0
                self.log(Event(step, "proof", f"{wanted} not fired yet", time.monotonic()))
                threads.append(self.start_action(step, "force"))
                fault = self.start_fault(step, (kind, params))
                assert fault is not None
                threads.append(fault)
                self.quiesce(threads)
                self.verify(("always", "quiescent"))
            if not self.fired()[wanted]:
                say(f"required fault {wanted} did not fire in 5 tries")

    # ---------------------------------------------------------------- quiescence

    def quiesce(self, threads: list[threading.Thread]) -> None:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=1)
                self.verify(("always",))
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
        self.p.quiescent_points += 1

    # ---------------------------------------------------------------- invariants

    def check(self, when: tuple[invariants.When, ...]) -> list[invariants.Violation]:
        phase = self.p
        found = self.retrying(lambda: phase.checker.check(self.dsn, phase.keys, when))
        if "quiescent" in when:
            succeeded = [
                (r["dag_id"], r["run_id"], r["task_id"], int(r["try_number"]))
                for r in self.stack.query(
                    "SELECT ti.dag_id, ti.run_id, ti.task_id, ti.try_number FROM task_instance ti"
                    " JOIN dag_run r ON r.dag_id = ti.dag_id AND r.run_id = ti.run_id"
                    " WHERE ti.state = 'success' AND r.id > ?",
                    (phase.base_run_id,),
                )
            ]
            found += self.retrying(lambda: phase.checker.check_executions(self.dsn, succeeded))
        return found

    def verify(self, when: tuple[invariants.When, ...], final: bool = False) -> None:
        """Check; on a violation report it and end the phase (raise :class:`PhaseOver`)."""
        phase = self.p
        violations = self.check(when)
        if when != ("always",) or violations:
            kind = "final" if final else "+".join(when)
            verdict = "OK" if not violations else f"{len(violations)} VIOLATED"
            say(f"phase {phase.build.name} step {phase.steps}: invariants ({kind}): {verdict}")
        if not violations:
            return
        phase.violations += violations
        phase.caught_at_step = phase.steps
        phase.caught_after = time.monotonic() - phase.loop_t0
        self.report(violations)
        raise PhaseOver()

    # ---------------------------------------------------------------- convergence

    def converge(self) -> None:
        phase = self.p
        say(f"convergence: rerunning {len(phase.touched)} touched date(s) until completed")
        for round_ in range(1, 6):
            keys = sorted(phase.touched)
            status = {
                (j, k): s
                for j, k, s in self.db_rows(
                    "SELECT job_name, run_key, status FROM idempotency.job_runs"
                )
            }
            todo = [
                d
                for d in keys
                if any(status.get((j, d.isoformat())) != "completed" for j in invariants.JOBS)
            ]
            # A forced reconcile that crashed left its key started (and its attempt running):
            # only another forced reconcile runs that job again, so convergence does one.
            reconcile = {
                d
                for d in keys
                if status.get((RECONCILE_EXPORT_JOB, d.isoformat())) not in (None, "completed")
            }
            todo = sorted(set(todo) | reconcile)
            if not todo:
                return
            runs = []
            for day in todo:
                event = self.log(
                    Event(phase.steps, "converge", f"{day} round {round_}", time.monotonic())
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

    def report(self, violations: list[invariants.Violation]) -> None:
        phase = self.p
        broken = f" --builds {phase.build.name}" if phase.build.broken else ""
        print("\n" + "=" * 100)
        print(
            f"CHAOS INVARIANT VIOLATION at step {phase.steps} of build {phase.build.name}: "
            f"seed {phase.seed} (replay: python3 dev.py chaos --seed {self.seed}"
            f" --steps {self.args.steps}{broken})"
        )
        if phase.build.broken:
            print(f"  (expected: the broken build {phase.build.name}, {phase.build.what})")
        for v in violations:
            print(v.text())
        print("action log:")
        with self.lock:
            for event in phase.events:
                print("  " + event.line(phase.t0))
        print("=" * 100, flush=True)

    def summary(self) -> dict[str, Any]:
        phase = self.p
        caught_by = sorted({v.invariant.name for v in phase.violations})
        return {
            "build": phase.build.name,
            "broken": phase.build.broken,
            "ok": phase.ok,
            "seed": phase.seed,
            "steps": phase.steps,
            "seconds": round(time.monotonic() - phase.t0, 1),
            "caught_at_step": phase.caught_at_step,
            "caught_after_seconds": (
                round(phase.caught_after, 1) if phase.caught_after is not None else None
            ),
            "violations": caught_by,
            "dates": phase.keys,
            "orders_per_date": self.args.orders,
            "actions": dict(sorted(phase.actions.items())),
            "faults": dict(sorted(phase.faults.items())),
            "fault_results": dict(sorted(phase.fault_results.items())),
            "fired": self.fired(),
            "quiescent_points": phase.quiescent_points,
            "components_restarted": dict(self.revived),
            "crashes_claimed": self.crashes_claimed(),
            "invariant_checks": dict(sorted(phase.checker.checked.items())),
            "attempt_outcomes": dict(
                self.db_rows(
                    "SELECT outcome, count(*) FROM idempotency.job_run_attempts"
                    " GROUP BY 1 ORDER BY 1"
                )
            ),
            "witness": {
                "work transactions": self.db_rows("SELECT count(*) FROM work_witness")[0][0],
                "lock sessions ended": self.db_rows("SELECT count(*) FROM witness_lock_losses")[0][
                    0
                ],
            },
            # Every request that reached the remote, from its own log (all its instances).
            "remote": {
                **dict(
                    self.db_rows(
                        "SELECT outcome, count(*) FROM accounting.requests GROUP BY 1 ORDER BY 1"
                    )
                ),
                "invoices": self.db_rows("SELECT count(*) FROM accounting.invoices")[0][0],
            },
        }


# ------------------------------------------------------------------------- the command


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{what}: {', '.join(unknown) or 'none given'}; choose from {', '.join(known)}"
        )
    return names


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed (printed)")
    parser.add_argument("--steps", type=int, default=60, help="steps of a correct phase")
    parser.add_argument(
        "--minutes", type=float, default=30.0, help="stop drawing steps after this (a phase)"
    )
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
    builds = tuple(BUILDS)
    parser.add_argument(
        "--builds",
        type=lambda text: _names(text, builds, "--builds"),
        default=[CORRECT],
        help="the builds to run, one phase each on one stack, comma-separated: "
        + ", ".join(builds),
    )
    parser.add_argument(
        "--broken",
        choices=BROKEN,
        default=None,
        help="run only this deliberately broken copy of the provider (= --builds NAME)",
    )
    parser.add_argument(
        "--broken-steps",
        type=int,
        default=25,
        help="steps a broken build's phase may take to be caught",
    )
    parser.add_argument(
        "--broken-seed",
        type=int,
        default=None,
        help="the seed of every broken build's phase (default: each build's own, "
        "devtools/chaos/builds.py)",
    )
    parser.add_argument(
        "--require-fired",
        type=lambda text: _names(text, tuple(PROOFS), "--require-fired"),
        default=[],
        help="faults a correct phase must have seen happen (forced at its end if not): "
        + ", ".join(PROOFS),
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
    return parser


def phase_dates(args: argparse.Namespace) -> list[tuple[dt.date, dt.date]]:
    """The business dates of each phase, first and last: after every earlier phase's (so that
    their Airflow runs never collide). Raises ValueError when a phase would need a day that
    has not ended, before anything starts."""
    plan: list[tuple[dt.date, dt.date]] = []
    yesterday = dt.datetime.now(dt.timezone.utc).date() - dt.timedelta(days=1)
    for name in args.builds:
        build = BUILDS[name]
        steps = args.broken_steps if build.broken else args.steps
        count = (build.dates or args.dates) + (
            steps // args.new_date_every if args.new_date_every else 0
        )
        first = plan[-1][1] + dt.timedelta(days=1) if plan else FIRST_DATE
        last = first + dt.timedelta(days=count - 1)
        if last > yesterday:
            raise ValueError(
                f"phase {name} would need business dates up to {last}, and only ended days "
                f"(up to {yesterday}) can run: fewer --steps or --builds, or a larger "
                "--new-date-every"
            )
        plan.append((first, last))
    return plan


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.broken:
        args.builds = [args.broken]
    if args.steps < 1 or args.dates < 1 or args.orders < 1 or args.overlap < 1:
        parser().error("--steps, --dates, --orders and --overlap must be at least 1")
    if args.new_date_every < 0 or args.check_every < 1 or args.broken_steps < 1:
        parser().error("--new-date-every must not be negative, --check-every at least 1")
    if args.from_summary:
        if not args.faults_md:
            parser().error("--from-summary needs --faults-md")
        saved = json.loads(args.from_summary.read_text(encoding="utf-8"))
        write_faults_md(args.faults_md, render_markdown(saved, saved.get("command", "")))
        return 0
    try:
        phase_dates(args)  # every phase's dates exist, before a stack starts
    except ValueError as exc:
        parser().error(str(exc))
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 10**6)
    # SIGTERM (a CI timeout, a test's clean-up) unwinds like Ctrl-C: the stack, the service
    # and the private server are stopped by the finally blocks, none is left behind.
    signal.signal(signal.SIGTERM, _terminate)
    chaos = Chaos(args)
    error = ""
    try:
        chaos.run()
    except Exception as exc:  # the set-up failed: reported, the summary says so
        error = f"{type(exc).__name__}: {exc}"
        say(f"chaos could not run: {error}")
    phases = [p.summary or {"build": p.build.name, "ok": False} for p in chaos.phases]
    summary = {
        "seed": args.seed,
        "startup_seconds": round(chaos.startup_seconds, 1),
        "phases": phases,
        "error": error,
        "command": "python3 dev.py chaos " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print("chaos summary: " + json.dumps(summary, default=str), flush=True)
    for phase in phases:
        verdict = "as expected" if phase.get("ok") else "NOT AS EXPECTED"
        say(
            f"build {phase.get('build')}: {verdict} ({phase.get('steps')} steps, "
            f"{phase.get('seconds')} s, violations: {phase.get('violations') or 'none'})"
        )
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    if args.faults_md:
        write_faults_md(args.faults_md, render_markdown(summary, summary["command"]))
    complete = len(phases) == len(args.builds) and not error
    return 0 if complete and all(p.get("ok") for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
