"""Drive a scale cell's N runs (bench/scale.py): threads of this process, or of K processes.

Each run is a thread calling ``run_idempotently`` whose work sleeps, writes one row through
``run.transaction()`` and, every third run, sends effects through the ledger. With
``Scenario.processes`` 1 every thread is this process's; with K > 1 the runs are spread over
K processes (started with ``spawn``: this process already has threads, which ``fork`` would
copy in whatever state they were), each driving about N / K threads, all released together by
one event across the processes. A process's GIL serializes its threads' Python code: a
thousand threads of one process measure the driver as much as the provider, and real runs
are tasks of many processes.

Either way the cell gets the same :class:`Driven`: each run's :class:`Outcome`, when each
run's work began, the release time ``t0`` (``time.monotonic()``, one clock for every
process of the machine), the wall time, where the runs still running at the bound were, and
a way to wait for those (``finish``) once their sessions are ended.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

from airflow_idempotency import RunContext, run_idempotently
from airflow_idempotency.ledger import Effect, OutboundLedger, post_json
from airflow_idempotency.run_context import RunEnvironment

if TYPE_CHECKING:
    from bench.scale import Scenario

JOB = "bench.scale"
REMOTE_SYSTEM = "scale_remote"
EXPORT_PATH = "/api/invoices"
THREAD_STACK = 512 * 1024  # a thousand threads at the default 8 MiB is 8 GiB of address space
# A thousand runs log three lines each at INFO; the benchmark reads outcomes, not logs.
QUIET = logging.getLogger("bench.scale.runs")
QUIET.addHandler(logging.NullHandler())
QUIET.propagate = False
START_SECONDS = 180.0  # K processes spawned, imported and their threads started (busy machine)
REPORT_SECONDS = 60.0  # a process's report after the bound (its runs' outcomes, pickled)


@dataclass
class Outcome:
    """One run: how its call ended and how long it and its work took."""

    seconds: float
    work_seconds: float | None
    error: BaseException | None
    ended: float  # time.monotonic()


class RunError(Exception):
    """A run's failure in another process, by its class's name and message (an exception
    of any class may not pickle)."""

    def __init__(self, name: str, text: str) -> None:
        super().__init__(name, text)  # the arguments it is unpickled with
        self.name = name
        self.text = text

    def __str__(self) -> str:
        return self.text


def error_name(error: BaseException) -> str:
    """The class name of a run's failure, in this process or another."""
    return error.name if isinstance(error, RunError) else type(error).__name__


@dataclass
class Driven:
    """What driving the runs gave the cell."""

    outcomes: dict[int, Outcome]
    began: dict[int, float]  # run index -> time.monotonic() when its work began
    t0: float  # the release
    wall_seconds: float  # the release -> every run ended, or the bound
    waiting_in: Counter[str] = field(default_factory=Counter)  # runs still running at the bound
    # join the runs still running until a deadline; how many remain then
    finish: Callable[[float], int] = field(default=lambda deadline: 0)

    @property
    def timed_out(self) -> bool:
        return sum(self.waiting_in.values()) > 0


def run_key(index: int) -> str:
    return f"k{index:05d}"


def drive(scenario: Scenario, dsn: str, url: str, prefix: str) -> Driven:
    """Run the cell's runs at once, in threads (``scenario.processes`` 1) or processes."""
    processes = max(1, min(scenario.processes, scenario.runs))
    if processes == 1:
        return _drive_threads(scenario, dsn, url, prefix)
    return _drive_processes(scenario, (dsn, url, prefix), processes)


# ---------------------------------------------------------------- the runs, as threads


class _Runs:
    """The threads of some of a cell's runs, each waiting for ``go`` then calling
    ``run_idempotently`` once; their outcomes and their works' start times by run index."""

    def __init__(
        self, scenario: Scenario, where: tuple[str, str, str], indices: range, go: threading.Event
    ) -> None:
        self.outcomes: dict[int, Outcome] = {}
        self.began: dict[int, float] = {}
        self._scenario = scenario
        self._where = where
        self._go = go
        self._environment = RunEnvironment(logger=QUIET)
        self._mode = mode_kwargs(scenario.lock_mode)
        old_stack = threading.stack_size(THREAD_STACK)
        try:
            self.threads = [
                threading.Thread(target=self._one, args=(i,), name=f"scale-run-{i}", daemon=True)
                for i in indices
            ]
            for thread in self.threads:
                thread.start()
        finally:
            threading.stack_size(old_stack)

    def _one(self, index: int) -> None:
        self._go.wait()
        dsn, url, prefix = self._where
        t = time.monotonic()
        spent: float | None = None
        error: BaseException | None = None
        try:
            run_idempotently(
                connect=lambda: psycopg.connect(dsn),
                job_name=JOB,
                run_key=run_key(index),
                work=_work(self._scenario, index, url, prefix, self.began),
                environment=self._environment,
                **self._mode,
            )
        except BaseException as exc:  # every failure is a result of the cell
            error = exc
        end = time.monotonic()
        if index in self.began and error is None:
            spent = end - self.began[index]
        self.outcomes[index] = Outcome(end - t, spent, error, end)

    def join(self, deadline: float) -> list[threading.Thread]:
        """Wait for the runs until ``deadline``; the threads still running then."""
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t for t in self.threads if t.is_alive()]


def mode_kwargs(mode: str) -> dict[str, Any]:
    """``lock_mode=mode`` when ``run_idempotently`` takes it (else today's only mode)."""
    if "lock_mode" in inspect.signature(run_idempotently).parameters:
        return {"lock_mode": mode}
    return {}


def _work(scenario: Scenario, index: int, url: str, prefix: str, began: dict[int, float]) -> Any:
    def work(run: RunContext) -> dict[str, int]:
        began[index] = time.monotonic()
        time.sleep(scenario.work_seconds)
        with run.transaction() as cur:
            cur.execute("INSERT INTO public.scale_work (run_key) VALUES (%s)", (run.run_key,))
        if not scenario.exports(index):
            return {"rows": 1}
        effects = [
            Effect(
                idempotency_key=f"{prefix}{run.run_key}:{e}",
                request={"run_key": run.run_key, "effect": e, "amount_cents": 100},
            )
            for e in range(scenario.effects_per_export)
        ]
        ledger = OutboundLedger(run, REMOTE_SYSTEM, concurrency=2)
        summary = ledger.send_all(effects, post_json(EXPORT_PATH), base_url=url)
        return {"rows": 1, **summary.as_counts("effects")}

    return work


def _drive_threads(scenario: Scenario, dsn: str, url: str, prefix: str) -> Driven:
    go = threading.Event()
    runs = _Runs(scenario, (dsn, url, prefix), range(scenario.runs), go)
    t0 = time.monotonic()
    go.set()
    alive = runs.join(t0 + scenario.bound)
    driven = Driven(runs.outcomes, runs.began, t0, time.monotonic() - t0)
    if alive:
        driven.waiting_in = where_waiting(alive)
        driven.finish = lambda deadline: len(runs.join(deadline))
    return driven


def where_waiting(threads: list[threading.Thread]) -> Counter[str]:
    """Where the runs still running at the bound were: the innermost frame of the provider,
    then of psycopg, in each thread's stack (``module:function:line``)."""
    frames = sys._current_frames()
    where: Counter[str] = Counter()
    for thread in threads:
        frame = frames.get(thread.ident or -1)
        stack = traceback.extract_stack(frame) if frame is not None else []
        spots = []
        for package in ("airflow_idempotency", "psycopg"):
            inner = [f for f in stack if f"/{package}/" in f.filename]
            if inner:
                f = inner[-1]
                spots.append(f"{Path(f.filename).stem}:{f.name}:{f.lineno}")
        where[" > ".join(spots) or "?"] += 1
    return where


# ---------------------------------------------------------------- the runs, in K processes


def _shares(runs: int, processes: int) -> list[range]:
    """Run indices 0..runs-1 in ``processes`` contiguous shares differing by at most one."""
    cuts = [runs * k // processes for k in range(processes + 1)]
    return [range(cuts[k], cuts[k + 1]) for k in range(processes)]


def _drive_processes(scenario: Scenario, where: tuple[str, str, str], processes: int) -> Driven:
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    t0_shared = ctx.Value("d", 0.0)
    children: list[tuple[Any, Connection, range]] = []
    for share in _shares(scenario.runs, processes):
        ours, theirs = ctx.Pipe()
        child = ctx.Process(
            target=_child,
            args=(theirs, scenario, where, share, go, t0_shared),
            name=f"scale-driver-{share.start}",
            daemon=True,
        )
        child.start()
        theirs.close()
        children.append((child, ours, share))
    try:
        start_by = time.monotonic() + START_SECONDS
        for _, conn, share in children:  # every run's thread started, waiting for go
            if not conn.poll(max(0.0, start_by - time.monotonic())) or conn.recv() != "ready":
                raise RuntimeError(
                    f"the driver process of runs {share.start}..{share.stop - 1} did not start "
                    f"its threads within {START_SECONDS:.0f} s: is the machine overloaded?"
                )
        t0 = time.monotonic()
        t0_shared.value = t0
        go.set()
        driven = _collect(scenario, children, t0)
    except BaseException:
        _stop(children)
        raise
    driven.finish = lambda deadline: _finish(children, deadline)
    if not driven.timed_out:
        _stop(children)
    return driven


def _collect(
    scenario: Scenario, children: list[tuple[Any, Connection, range]], t0: float
) -> Driven:
    """Each process's report after its runs ended or the bound passed, merged."""
    driven = Driven({}, {}, t0, 0.0)
    report_by = t0 + scenario.bound + REPORT_SECONDS
    joined = t0
    for child, conn, share in children:
        if not conn.poll(max(0.0, report_by - time.monotonic())):
            driven.waiting_in[f"driver process of runs {share.start}.. (no report)"] += len(share)
            child.kill()
            conn.close()
            continue
        outcomes, began, ended, waiting_in = conn.recv()
        driven.outcomes.update(outcomes)
        driven.began.update(began)
        driven.waiting_in.update(waiting_in)
        joined = max(joined, ended)
    driven.wall_seconds = joined - t0
    return driven


def _finish(children: list[tuple[Any, Connection, range]], deadline: float) -> int:
    """Each process joins its runs still running until ``deadline``: how many remain."""
    remaining = 0
    for _, conn, _share in children:
        if conn.closed:
            continue
        try:
            conn.send(deadline)
            if conn.poll(max(0.0, deadline - time.monotonic()) + REPORT_SECONDS):
                remaining += int(conn.recv())
        except (OSError, EOFError):
            continue
    _stop(children)
    return remaining


def _stop(children: list[tuple[Any, Connection, range]]) -> None:
    """End the driver processes: each exits once its pipe closes (a timed-out run's thread
    is a daemon, it ends with its process)."""
    for _, conn, _ in children:
        conn.close()
    for child, _, _ in children:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(10)


def _child(
    conn: Connection,
    scenario: Scenario,
    where: tuple[str, str, str],
    share: range,
    go: Any,
    t0_shared: Any,
) -> None:
    """A driver process: start the share's runs, release them with every other process's,
    report their outcomes at the end or the bound, then join what still runs when asked."""
    release = threading.Event()
    runs = _Runs(scenario, where, share, release)
    conn.send("ready")
    if not go.wait(START_SECONDS + 60):
        return  # the parent gave up (another process did not start): end with it
    release.set()
    t0 = float(t0_shared.value)
    alive = runs.join(t0 + scenario.bound)
    ended = time.monotonic()
    outcomes = {i: _portable(o) for i, o in dict(runs.outcomes).items()}
    waiting_in = where_waiting(alive) if alive else Counter[str]()
    conn.send((outcomes, dict(runs.began), ended, waiting_in))
    try:
        deadline = conn.recv()  # the sessions of the runs still running were ended
    except EOFError:
        return
    conn.send(len(runs.join(float(deadline))))


def _portable(outcome: Outcome) -> Outcome:
    if outcome.error is None:
        return outcome
    error = RunError(type(outcome.error).__name__, str(outcome.error))
    return Outcome(outcome.seconds, outcome.work_seconds, error, outcome.ended)
