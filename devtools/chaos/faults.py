"""Chaos's faults: what breaks under the actions, drawn from the seed independently of them.

Each step draws (with probability ``--fault-rate``) one fault, which starts after a short
random delay in a thread of its own:

``crash`` (a crash point armed in AIRFLOW_IDEMPOTENCY_FAULT_DIR: the next worker process that
reaches it SIGKILLs itself), ``terminate_lock`` (pg_terminate_backend of a session holding a
run lock, found while a stall armed in the same folder holds one run at a point for 3 s, often
in its open work transaction; the database clock once that backend is gone is recorded in
``witness_lock_losses``; in a phase of the lease mode, where no session holds a key, its
counterpart ``take_over_lease``: the lease of a running attempt taken over as a successor
does, recorded in ``witness_lease_losses``), ``remote_5xx``, ``remote_reset``,
``remote_timeout`` (commit then no answer), ``remote_latency`` (the accounting service's fault
injection, for some seconds), ``service_kill`` (the accounting service SIGKILLed, restarted on
the same port after a few seconds), ``pg_restart`` (the job database stopped fast or
immediate, started again; a lease outlives it, the sessions do not).

:meth:`Faults.fired` counts the faults that really happened (``--require-fired``).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from devtools import invariants
from devtools.chaos.phases import Event, Phase, say
from devtools.chaos.rig import Rig, retrying
from devtools.invariants import FINALIZE, RECONCILE_JOB

FAULTS: dict[str, int] = {  # kind -> weight
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
# The accounting service's fault injection of each remote_* fault.
REMOTE_FAULTS: dict[str, dict[str, Any]] = {
    "remote_5xx": {"fail_rate": 0.3},
    "remote_reset": {"reset_rate": 0.2, "reset_phase": "after_commit"},
    "remote_timeout": {"timeout_after_commit_rate": 0.1, "hang_seconds": 5.0},
    "remote_latency": {"latency_ms": 300.0},
}
# Jobs whose work transactions the example witnesses (work_witness).
WITNESSED_JOBS = (f"{FINALIZE}.create_invoices", f"{FINALIZE}.rebuild_totals", RECONCILE_JOB)
# Where terminate_lock stalls one run (3 s) so that a lock session is there to end: in the
# open work transaction of a witnessed job, or (for any run) just after its attempt started.
STALL_SECONDS = 3
STALL_IN_WORK = ("invoices.before_commit", "totals.after_delete")
STALL_ANY = "runner.after_started"
# What --require-fired can ask for, and the fault that fires it (terminate_lock: a run's lock
# lost to chaos, by take_over_lease in the lease mode).
PROOFS = {"crash": "crash", "terminate_lock": "terminate_lock", "restart": "pg_restart"}
# A fault's counterpart in the lease mode: no session holds a lease, so none is terminated;
# the lease is lost the way a lease is, to a take-over.
LEASE_COUNTERPARTS = {"terminate_lock": "take_over_lease"}
# How long a take-over waits for the holder's open fenced transactions (as a successor's start
# does, AIRFLOW_IDEMPOTENCY_LOCK_WAIT at most).
TAKE_OVER_WAIT_MS = 30_000


def arm_stall(fault_dir: Path, step: int, point: str) -> Path:
    """Arm a stall at ``point``: the next run to pass it holds its lock there for
    :data:`STALL_SECONDS`. Returns the armed file (removing it disarms the stall)."""
    stall = fault_dir / f"{point}.stall"
    staging = fault_dir / f"staging-{step}-{point}"
    staging.write_text(str(STALL_SECONDS))
    staging.replace(stall)  # a worker never reads a half-written file
    return stall


def pick_victim(
    held: Callable[[], list[dict[str, Any]]], p: dict[str, Any], stall: Path | None
) -> dict[str, Any] | None:
    """One of the run locks ``held()`` lists (rows with a ``job_name``), or None.

    Run locks live only while a task runs, often for less than the time between two looks:
    the caller arms a ``stall`` (:func:`arm_stall`; inside the run's open work transaction
    when ``p["work"]``), and this waits up to 15 s for a lock (one whose attempt does
    witnessed work, when ``p["work"]``), then disarms the stall. ``p["pick"]`` (0 to 1)
    picks the victim among the candidates.
    """
    deadline = time.monotonic() + 15
    try:
        while True:
            locks = retrying(held)
            working = [s for s in locks if s["job_name"] in WITNESSED_JOBS]
            candidates = working if p["work"] else locks
            if candidates or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        if stall is not None:
            stall.unlink(missing_ok=True)  # not claimed by then: disarmed
    candidates = candidates or locks
    return candidates[int(p["pick"] * len(candidates))] if candidates else None


def take_over_lease(dsn: str, event: Event, p: dict[str, Any], stall: Path | None = None) -> str:
    """The lease mode's :func:`terminate_lock`: take a running attempt's lease over as a
    successor's start does (the key's fence key exclusively, so after the holder's open
    fenced transactions; a new token; the lease left expired, free to take), and record the
    attempt and the database clock once the take-over committed (``witness_lease_losses``).
    The victim is picked as :func:`pick_victim` says."""
    victim = pick_victim(lambda: invariants.live_leases(dsn), p, stall)
    if victim is None:
        return "no lease held"
    event.what = f"lease {victim['token']} of attempt {victim['attempt_id']} ({victim['job_name']})"
    params = {**victim, "wait_ms": TAKE_OVER_WAIT_MS}
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        with conn.transaction():
            conn.execute(invariants.queries()["take_over_fence"], params)
            taken = conn.execute(invariants.queries()["take_over_lease"], params).fetchone()
        if taken is None:
            return "lease gone: released or taken over meanwhile"
        conn.execute(invariants.queries()["record_lease_loss"], params)
    return "taken over"


def terminate_lock(dsn: str, event: Event, p: dict[str, Any], stall: Path | None = None) -> str:
    """End a run lock's session; record when the database no longer had it. The victim is
    picked as :func:`pick_victim` says."""
    victim = pick_victim(lambda: invariants.run_lock_sessions(dsn), p, stall)
    if victim is None:
        return "no lock held"
    event.what = f"backend {victim['pid']} ({victim['job_name'] or 'no attempt yet'})"
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
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


class Faults:
    """Draws the faults of a phase and injects them into the rig, each in a thread of its own."""

    def __init__(self, rig: Rig, args: argparse.Namespace) -> None:
        self.rig = rig
        self.args = args
        self.timers: list[threading.Timer] = []

    def plan(self, phase: Phase) -> tuple[str, dict[str, Any]] | None:
        """Draw whether a fault comes at this step (the build's rate or ``--fault-rate``) and
        which one, with its parameters."""
        rate = phase.build.fault_rate
        if phase.rng.random() >= (self.args.fault_rate if rate is None else rate):
            return None
        weights = phase.build.faults or FAULTS
        kind = phase.rng.choices(list(weights), weights=list(weights.values()))[0]
        return kind, self.params(phase, kind)

    @staticmethod
    def for_mode(phase: Phase, kind: str) -> str:
        """The fault ``kind`` means in ``phase``'s lock mode (:data:`LEASE_COUNTERPARTS`)."""
        return LEASE_COUNTERPARTS.get(kind, kind) if phase.lock_mode == "lease" else kind

    def params(self, phase: Phase, kind: str) -> dict[str, Any]:
        rng = phase.rng
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
            share = 1.0 if phase.build.faults.get("terminate_lock") else 0.5
            params["work"] = rng.random() < share
            params["stall_at"] = rng.choice(STALL_IN_WORK) if params["work"] else STALL_ANY
        return params

    def start(
        self, phase: Phase, step: int, planned: tuple[str, dict[str, Any]] | None = None
    ) -> threading.Thread | None:
        """The fault of ``step`` (``planned``, or drawn) in a thread of its own (started), or
        None when this step has none."""
        planned = planned or self.plan(phase)
        if planned is None:
            return None
        kind, params = planned
        kind = self.for_mode(phase, kind)
        phase.faults[kind] += 1
        event = phase.log(Event(step, kind, "", time.monotonic()))

        def body() -> None:
            time.sleep(params["delay"])
            event.began = time.monotonic()
            try:
                event.result = self.do(event, kind, params)
            except Exception as exc:
                event.result = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            finally:
                event.ended = time.monotonic()
                say(event.line(phase.t0))
            phase.fault_results[f"{kind}: {event.result.split(':')[0]}"] += 1

        thread = threading.Thread(target=body, name=f"fault-{step}", daemon=True)
        thread.start()
        return thread

    def do(self, event: Event, kind: str, p: dict[str, Any]) -> str:
        remote = self.rig.remote
        if kind == "crash":
            event.what = p["point"]
            (self.rig.fault_dir / p["point"]).touch()
            return "armed"
        if kind in ("terminate_lock", "take_over_lease"):
            stall = None  # a caller that holds its own run's lock open passes no stall_at
            if p.get("stall_at"):
                stall = arm_stall(self.rig.fault_dir, event.step, p["stall_at"])
            lose = terminate_lock if kind == "terminate_lock" else take_over_lease
            return lose(self.rig.dsn, event, p, stall)
        if kind in REMOTE_FAULTS:
            settings = REMOTE_FAULTS[kind]
            event.what = f"{settings} for {p['seconds']:.0f} s"
            if not remote.set_faults(**settings):
                return "service down"
            timer = threading.Timer(p["seconds"], remote.clear_faults)
            timer.daemon = True
            timer.start()
            self.timers.append(timer)
            return "set"
        if kind == "service_kill":
            event.what = f"down {p['down']:.1f} s"
            remote.stop(kill=True)
            time.sleep(p["down"])
            remote.ensure()
            return "restarted"
        if kind == "pg_restart":
            event.what = f"-m {p['mode']}, down {p['down']:.1f} s"
            self.rig.pg.restart(p["mode"], p["down"])
            time.sleep(1)
            remote.ensure()
            return "restarted"
        raise ValueError(kind)

    def cancel_timers(self) -> None:
        for timer in self.timers:
            timer.cancel()
        self.timers.clear()

    def disarm(self) -> None:
        """No fault left: timers cancelled, armed points removed, the service up, unfaulted."""
        self.cancel_timers()
        for armed in self.rig.fault_dir.iterdir():
            if ".claimed-by-" not in armed.name:
                armed.unlink()
        self.rig.remote.ensure()
        self.rig.remote.clear_faults()

    def crashes_claimed(self) -> list[str]:
        """The crash points a worker claimed (stalls armed by terminate_lock are not crashes)."""
        return sorted(
            point
            for point, claimed, _ in (
                p.name.partition(".claimed-by-") for p in self.rig.fault_dir.iterdir()
            )
            if claimed and not point.endswith(".stall")
        )

    def fired(self, phase: Phase) -> dict[str, int]:
        """Faults that really happened: crash points claimed by a worker, locks lost (lock
        sessions ended, leases taken over), restarts (the database or the service)."""
        results = phase.fault_results
        return {
            "crash": len(self.crashes_claimed()),
            "terminate_lock": results["terminate_lock: terminated"]
            + results["take_over_lease: taken over"],
            "restart": results["pg_restart: restarted"] + results["service_kill: restarted"],
        }
