"""The phases of a chaos run: one per build, each with its business dates, seed and action log.

A phase is a build in a lock mode (``--builds correct,fence-off:lease``, :func:`planned_builds`).
Each phase takes business dates after every earlier phase's, so that their Airflow runs never
collide (:func:`phase_dates`); a correct build's phase draws from ``--seed``, a broken build's
from its own fixed seed (:func:`new_phase`). Actions and faults append an :class:`Event` to
the phase's log; a violation ends the phase (:class:`PhaseOver`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from devtools import invariants
from devtools.chaos.builds import Build, split_phase

FIRST_DATE = dt.date(2026, 10, 1)


def say(text: str) -> None:
    print(f"[chaos {dt.datetime.now(dt.timezone.utc):%H:%M:%S}] {text}", flush=True)


@dataclass
class Event:
    """One line of the action log: an action, a fault, a revival or a convergence run."""

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
    lock_mode: str
    dates: list[dt.date]
    window_size: int
    rng: random.Random
    t0: float = field(default_factory=time.monotonic)
    loop_t0: float = 0.0
    base_run_id: int = 0  # dag_run ids above this one are this phase's
    events: list[Event] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # of events
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
    mode_used: bool = False  # its runs held their keys in its lock mode (Rig.mode_used)

    @property
    def name(self) -> str:
        """The build and its lock mode: ``correct:lease``."""
        return f"{self.build.name}:{self.lock_mode}"

    @property
    def keys(self) -> list[str]:
        return sorted(d.isoformat() for d in self.touched)

    @property
    def ok(self) -> bool:
        """A correct build kept every invariant; a broken one was caught by what must; both
        in their lock mode."""
        if not self.mode_used:
            return False
        if not self.build.broken:
            return not self.violations and bool(self.summary.get("converged"))
        names = {v.invariant.name for v in self.violations}
        return bool(names & set(self.build.caught_by))

    def log(self, event: Event) -> Event:
        """``event``, appended to the action log (actions and faults log from their threads)."""
        with self.lock:
            self.events.append(event)
        return event

    def log_lines(self) -> list[str]:
        """The action log, one line per event, times from the phase's start."""
        with self.lock:
            return [event.line(self.t0) for event in self.events]

    def window(self, step: int, new_date_every: int) -> list[dt.date]:
        """The business dates actions of ``step`` draw from: ``window_size`` dates that move on
        by one every ``new_date_every`` steps (0: never)."""
        start = step // new_date_every if new_date_every else 0
        start = min(start, len(self.dates) - self.window_size)
        return self.dates[start : start + self.window_size]


def phase_dates(args: argparse.Namespace) -> list[tuple[dt.date, dt.date]]:
    """The business dates of each phase, first and last: after every earlier phase's (so that
    their Airflow runs never collide). Raises ValueError when a phase would need a day that
    has not ended, before anything starts."""
    plan: list[tuple[dt.date, dt.date]] = []
    yesterday = dt.datetime.now(dt.timezone.utc).date() - dt.timedelta(days=1)
    for build, mode in planned_builds(args):
        name = f"{build.name}:{mode}"
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


def planned_builds(args: argparse.Namespace) -> list[tuple[Build, str]]:
    """The build and the lock mode of each phase: ``--builds`` (``NAME`` or ``NAME:MODE``),
    ``--lock-mode`` where no mode is named."""
    return [split_phase(text, args.lock_mode) for text in args.builds]


def new_phase(args: argparse.Namespace, index: int) -> Phase:
    """The ``index``-th phase of the run: its build and lock mode, its business dates (after
    every earlier phase's, so that their Airflow runs never collide), and its seed."""
    build, mode = planned_builds(args)[index]
    dates = build.dates or args.dates
    first, last = phase_dates(args)[index]
    count = (last - first).days + 1
    # A broken build runs with its own fixed seed (chosen so that it is caught every
    # time), unless --broken-seed says otherwise; a correct one with --seed.
    seed = args.seed
    if build.broken:
        seed = args.broken_seed or build.seed
    elif index:
        seed = random.Random(f"{args.seed}:{index}").randrange(1, 10**6)
    return Phase(
        build=build,
        index=index,
        seed=seed,
        lock_mode=mode,
        dates=[first + dt.timedelta(days=i) for i in range(count)],
        window_size=min(dates, count),
        rng=random.Random(seed),
    )
