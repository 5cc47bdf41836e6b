"""The run: every phase on one rig, each a loop of steps checked against the invariants.

Invariants (devtools/invariants.py): the history invariants (``always``: executions counted by
the witnesses) after every step and every second in between; the end-state ones at every
``--check-every`` steps once quiescent (all actions done, no DAG run active); at the end of a
correct phase every fault is disarmed, ``--require-fired`` faults that did not fire are forced
until they do, every touched date is rerun until all its jobs completed (convergence) and
everything is checked again. A violation prints the seed, the step, the action log, the
offending rows and the history of their keys, and ends the phase.
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from typing import Any

from devtools import invariants
from devtools.chaos.actions import Actions
from devtools.chaos.faults import PROOFS, Faults
from devtools.chaos.phases import Event, Phase, PhaseOver, new_phase, say
from devtools.chaos.rig import Rig, retrying


class Chaos:
    """The phases of one chaos run, in turn on one rig."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seed: int = args.seed
        self.t0 = time.monotonic()
        self.rig = Rig(args)
        self.actions = Actions(self.rig, args)
        self.faults = Faults(self.rig, args)
        self.phases: list[Phase] = []
        self.phase: Phase | None = None
        self.startup_seconds = 0.0

    @property
    def p(self) -> Phase:
        assert self.phase is not None
        return self.phase

    def run(self) -> None:
        """Every phase on one rig, set up once."""
        say(
            f"seed {self.seed}, builds {', '.join(self.args.builds)}; {self.args.steps} steps "
            f"a correct phase (at most {self.args.minutes} min), {self.args.broken_steps} a "
            f"broken one; work folder {self.rig.workdir}"
        )
        self.phase = new_phase(self.args, 0)
        with self.rig.up(self.p):
            try:
                self.startup_seconds = time.monotonic() - self.t0
                say(f"stack up after {self.startup_seconds:.0f} s")
                for index in range(len(self.args.builds)):
                    if index:
                        self.phase = new_phase(self.args, index)
                        self.rig.switch_to(self.p)
                    self.phases.append(self.p)
                    self.run_phase()
            finally:
                self.faults.cancel_timers()

    def run_phase(self) -> None:
        phase = self.p
        phase.t0 = time.monotonic()
        base = self.rig.stack.query("SELECT coalesce(max(id), 0) FROM dag_run")[0][0]
        phase.base_run_id = int(base)
        say(
            f"phase {phase.index + 1}: build {phase.build.name}, lock mode {phase.lock_mode}, "
            f"seed {phase.seed}, dates {phase.dates[0]}..{phase.dates[-1]}, "
            f"{self.args.orders} orders each"
        )
        threads: list[threading.Thread] = []
        try:
            self.loop(threads)
            if not phase.build.broken:
                self.quiesce(threads)
                self.prove_faults(threads)
                self.faults.disarm()
                self.actions.converge(phase)
                self.quiesce(threads)
                self.verify(("always", "quiescent", "converged"), final=True)
                phase.summary["converged"] = True
            else:
                say(f"phase {phase.name}: NOT caught in {phase.steps} steps")
        except PhaseOver:
            pass
        finally:
            if phase.caught_at_step is not None:
                self.rig.end_phase(phase)
            for thread in threads:  # the actions see their runs end; faults are short
                thread.join(timeout=120)
            self.faults.disarm()
            with contextlib.suppress(Exception):
                phase.summary["lock_mode_used"] = self.rig.check_mode_used(phase)
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
            threads.append(self.actions.start(phase, step))
            fault = self.faults.start(phase, step)
            if fault is not None:
                threads.append(fault)
            phase.steps = step
            self.pause(phase.rng.uniform(0.5, self.args.max_gap))
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

    def prove_faults(self, threads: list[threading.Thread]) -> None:
        """Fire each --require-fired fault that the seeded steps did not: a forced rerun of
        a date (its work holds locks, passes every crash point) with that fault, again
        until it fired (at most 5 times)."""
        phase = self.p
        for wanted in self.args.require_fired:
            for _ in range(5):
                if self.faults.fired(phase)[wanted]:
                    break
                step = phase.steps + 1
                phase.steps = step
                kind = PROOFS[wanted]  # Faults.start: its counterpart in the lease mode
                params = self.faults.params(phase, kind)
                if kind == "crash":
                    params["point"] = "runner.after_lock"  # every run passes it
                params["delay"] = 1.0
                phase.log(Event(step, "proof", f"{wanted} not fired yet", time.monotonic()))
                threads.append(self.actions.start(phase, step, "force"))
                fault = self.faults.start(phase, step, (kind, params))
                assert fault is not None
                threads.append(fault)
                self.quiesce(threads)
                self.verify(("always", "quiescent"))
            if not self.faults.fired(phase)[wanted]:
                say(f"required fault {wanted} did not fire in 5 tries")

    # ---------------------------------------------------------------- invariants

    def quiesce(self, threads: list[threading.Thread]) -> None:
        """Wait for every action and fault thread, then for no DAG run to be active."""
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=1)
                self.verify(("always",))
        threads.clear()
        deadline = time.monotonic() + self.args.action_timeout
        while time.monotonic() < deadline:
            self.rig.revive(self.p)
            active = self.rig.stack.query(
                "SELECT count(*) FROM dag_run WHERE state IN ('running', 'queued')"
            )[0][0]
            if not active:
                break
            time.sleep(1)
        self.p.quiescent_points += 1

    def check(self, when: tuple[invariants.When, ...]) -> list[invariants.Violation]:
        phase, dsn = self.p, self.rig.dsn
        found = retrying(lambda: phase.checker.check(dsn, phase.keys, when))
        if "quiescent" in when:
            succeeded = [
                (r["dag_id"], r["run_id"], r["task_id"], int(r["try_number"]))
                for r in self.rig.stack.query(
                    "SELECT ti.dag_id, ti.run_id, ti.task_id, ti.try_number FROM task_instance ti"
                    " JOIN dag_run r ON r.dag_id = ti.dag_id AND r.run_id = ti.run_id"
                    " WHERE ti.state = 'success' AND r.id > ?",
                    (phase.base_run_id,),
                )
            ]
            found += retrying(lambda: phase.checker.check_executions(dsn, succeeded))
        return found

    def verify(self, when: tuple[invariants.When, ...], final: bool = False) -> None:
        """Check; on a violation report it and end the phase (raise :class:`PhaseOver`)."""
        phase = self.p
        violations = self.check(when)
        if when != ("always",) or violations:
            kind = "final" if final else "+".join(when)
            verdict = "OK" if not violations else f"{len(violations)} VIOLATED"
            say(f"phase {phase.name} step {phase.steps}: invariants ({kind}): {verdict}")
        if not violations:
            return
        phase.violations += violations
        phase.caught_at_step = phase.steps
        phase.caught_after = time.monotonic() - phase.loop_t0
        self.report(violations)
        raise PhaseOver()

    # ---------------------------------------------------------------- what it found

    def report(self, violations: list[invariants.Violation]) -> None:
        phase = self.p
        broken = f" --builds {phase.name}" if phase.build.broken else ""
        print("\n" + "=" * 100)
        print(
            f"CHAOS INVARIANT VIOLATION at step {phase.steps} of build {phase.name}: "
            f"seed {phase.seed} (replay: python3 dev.py chaos --seed {self.seed}"
            f" --steps {self.args.steps}{broken})"
        )
        if phase.build.broken:
            print(f"  (expected: the broken build {phase.build.name}, {phase.build.what})")
        for v in violations:
            print(v.text())
        print("action log:")
        for line in phase.log_lines():
            print("  " + line)
        print("=" * 100, flush=True)

    def summary(self) -> dict[str, Any]:
        """The phase's summary (what the JSON summary and FAULTS.md show)."""
        phase, db_rows = self.p, self.rig.db_rows
        caught_by = sorted({v.invariant.name for v in phase.violations})
        return {
            "build": phase.build.name,
            "lock_mode": phase.lock_mode,
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
            "fired": self.faults.fired(phase),
            "quiescent_points": phase.quiescent_points,
            "components_restarted": dict(self.rig.revived),
            "crashes_claimed": self.faults.crashes_claimed(),
            "invariant_checks": dict(sorted(phase.checker.checked.items())),
            "attempt_outcomes": dict(
                db_rows(
                    "SELECT outcome, count(*) FROM idempotency.job_run_attempts"
                    " GROUP BY 1 ORDER BY 1"
                )
            ),
            "witness": {
                "work transactions": db_rows("SELECT count(*) FROM work_witness")[0][0],
                "lock sessions ended": db_rows("SELECT count(*) FROM witness_lock_losses")[0][0],
                "leases taken over": db_rows("SELECT count(*) FROM witness_lease_losses")[0][0],
            },
            # Every request that reached the remote, from its own log (all its instances).
            "remote": {
                **dict(
                    db_rows(
                        "SELECT outcome, count(*) FROM accounting.requests GROUP BY 1 ORDER BY 1"
                    )
                ),
                "invoices": db_rows("SELECT count(*) FROM accounting.invoices")[0][0],
            },
        }
