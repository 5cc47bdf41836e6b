"""Scale: N idempotent runs at once on one PostgreSQL of ``max_connections`` 100 (issue 32).

Each run is a thread of this process calling the public API,
``run_idempotently(connect=..., job_name=..., run_key=..., work=...)``, all released by one
event. Its work sleeps (``work_seconds``, outside any transaction), then writes one row of
``public.scale_work`` through ``run.transaction()``; every third run then sends
``effects_per_export`` effects through the outbound ledger to the example accounting service
(a deduplicating remote: one invoice per ``Idempotency-Key``).

A cell is one (path, lock mode, N):

* path ``direct``: ``psycopg.connect`` to the server; ``pgbouncer``: through a PgBouncer in
  ``pool_mode = transaction`` with ``default_pool_size`` = ``pool_size`` (20), as
  docs/deploying.md describes, ``query_wait_timeout`` set so that a stalled pool ends;
* lock mode ``advisory``: today's run lock; ``lease``: ``run_idempotently(...,
  lock_mode="lease")`` (issue 32's lease), reported "not available" while the provider has no
  such keyword.

Measured per cell: runs completed, failed (the first error's class), still running at the
cell's bound (a stalled cell ends there, its sessions ended, and says so: it never hangs the
benchmark), each key's work committed once (rows per key in the database), the effects the
remote holds (invoices under the cell's key prefix, and the replays it answered), the peak
of server connections to the cell's database (pg_stat_activity sampled every 50 ms), the wall
time and the overhead per completed run (the call's time minus the time inside its work).

The benchmark starts a PostgreSQL of its own (the system's binaries, ``max_connections``
100: the figure of the issue, whatever the shared server has) so that a thousand clients
never crowd the server other work uses; the accounting service keeps its data on the shared
server. tests/integration/test_scale.py runs the same cells at a small N.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from airflow_idempotency import RunContext, run_idempotently
from airflow_idempotency.ledger import Effect, OutboundLedger, post_json
from airflow_idempotency.run_context import RunEnvironment
from airflow_idempotency.schema import ensure_schema
from bench import scale_airflow
from bench.common import BenchResult, Size, at_most, load_average, median, percentile, say
from devtools import pgbouncer
from devtools.accounting import AccountingService, run_accounting_service
from devtools.postgres import (
    PostgresServer,
    dedicated_cluster,
    system_binaries,
    temporary_database,
)

TITLE = "Scale: N runs at once, direct and through a transaction pooler (issue 32)"
JOB = "bench.scale"
LOCK_MODES = ("advisory", "lease")
PATHS = ("direct", "pgbouncer")
MAX_CONNECTIONS = 100
POOL_SIZE = 20
EXPORT_EVERY = 3  # every third run sends effects
REMOTE_SYSTEM = "scale_remote"
EXPORT_PATH = "/api/invoices"
WORK_SECONDS = 2.0
SAMPLE_SECONDS = 0.05
GRACE_SECONDS = 30.0  # after a cell's bound: its sessions are ended, its threads get this long
THREAD_STACK = 512 * 1024  # a thousand threads at the default 8 MiB is 8 GiB of address space

# A thousand runs log three lines each at INFO; the benchmark reads outcomes, not logs.
_QUIET = logging.getLogger("bench.scale.runs")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


@dataclass(frozen=True)
class Scenario:
    """One cell: how many runs, which lock mode, which path, and the sizes around them."""

    runs: int
    lock_mode: str
    path: str
    pool_size: int = POOL_SIZE
    work_seconds: float = WORK_SECONDS
    effects_per_export: int = 10
    query_wait_timeout: int = 60  # PgBouncer's: how long a client waits for a server connection
    bound_seconds: float | None = None  # default: see ``bound``

    @property
    def label(self) -> str:
        via = f"pgbouncer pool {self.pool_size}" if self.path == "pgbouncer" else "direct"
        return f"{via}, {self.lock_mode}, N={self.runs}"

    @property
    def bound(self) -> float:
        """The cell's bound: a stalled pool's wait, then every run's work one pool-full at a
        time, twice over."""
        if self.bound_seconds is not None:
            return self.bound_seconds
        waves = -(-self.runs // self.pool_size)
        return 30 + self.query_wait_timeout + 2 * waves * (self.work_seconds + 0.5)

    def exports(self, index: int) -> bool:
        return index % EXPORT_EVERY == 0


@dataclass
class Outcome:
    """One run: how its call ended and how long it and its work took."""

    seconds: float
    work_seconds: float | None
    error: BaseException | None
    ended: float  # time.monotonic()


@dataclass
class Cell:
    """What one cell measured (or why it did not run)."""

    scenario: Scenario
    unavailable: str = ""  # why the cell did not run ("" when it ran)
    completed: int = 0
    failed: int = 0
    unfinished: int = 0  # still running at the bound
    timed_out: bool = False
    first_error: str = ""
    errors: Counter[str] = field(default_factory=Counter)
    keys_once: int = 0  # keys whose work committed exactly once
    keys_repeated: int = 0  # keys whose work committed more than once
    keys_of_failed_runs: int = 0  # keys whose work committed although their run did not complete
    stragglers: int = 0  # threads still alive after the bound and the grace
    waiting_in: Counter[str] = field(default_factory=Counter)  # where they were, at the bound
    effects_expected: int = 0  # effects of the exporting runs that completed
    effects_delivered: int = 0  # invoices the remote holds under the cell's prefix
    remote_requests: int = 0
    remote_replays: int = 0
    peak_server_connections: int = 0
    wall_seconds: float = 0.0
    overhead_ms: list[float] = field(default_factory=list)
    start_spread_ms: float = 0.0  # release -> the last run's work began

    @property
    def all_completed_once(self) -> bool:
        """Every run completed, each key's work committed once, every effect delivered."""
        n = self.scenario.runs
        return (
            not self.unavailable
            and self.completed == n
            and self.keys_once == n
            and self.keys_repeated == 0
            and self.effects_delivered == self.effects_expected
        )

    def error_counts(self) -> str:
        return ", ".join(f"{name} {n}" for name, n in self.errors.most_common())

    def summary(self) -> str:
        if self.unavailable:
            return f"{self.scenario.label}: not available ({self.unavailable})"
        return (
            f"{self.scenario.label}: {self.completed} completed, {self.failed} failed"
            + (f" (first: {self.first_error})" if self.first_error else "")
            + (f" [{self.error_counts()}]" if self.failed else "")
            + (
                f", {self.unfinished} still running at the {self.scenario.bound:.0f} s bound "
                f"({self.stragglers} after {GRACE_SECONDS:.0f} s more; at the bound in "
                + ", ".join(f"{w} x{n}" for w, n in self.waiting_in.most_common(3))
                + ")"
                if self.timed_out
                else ""
            )
            + f"; keys once {self.keys_once}, more than once {self.keys_repeated}, of "
            f"runs not completed {self.keys_of_failed_runs}; effects at the remote "
            f"{self.effects_delivered} (completed runs' {self.effects_expected}), replays {self.remote_replays}; "
            f"peak server connections {self.peak_server_connections}; "
            f"wall {self.wall_seconds:.1f} s"
        )


# ---------------------------------------------------------------- lock modes


def lock_mode_available(mode: str) -> str:
    """ "" when ``run_idempotently`` takes ``lock_mode=mode``; else why not."""
    if "lock_mode" in inspect.signature(run_idempotently).parameters:
        return ""
    if mode == "advisory":
        return ""  # today's only mode, without the keyword
    return "run_idempotently has no lock_mode keyword yet (TypeError)"


def _mode_kwargs(mode: str) -> dict[str, Any]:
    if "lock_mode" in inspect.signature(run_idempotently).parameters:
        return {"lock_mode": mode}
    return {}


# ---------------------------------------------------------------- one cell


class _Sampler:
    """The peak of server connections to one database, read every ``SAMPLE_SECONDS`` from a
    session in another database (so it never counts itself)."""

    def __init__(self, admin_dsn: str, dbname: str) -> None:
        self.peak = 0
        self._dbname = dbname
        self._stop = threading.Event()
        self._conn = psycopg.connect(admin_dsn, autocommit=True)
        self._thread = threading.Thread(target=self._loop, name="scale-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            row = self._conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (self._dbname,)
            ).fetchone()
            self.peak = max(self.peak, int(row[0]) if row else 0)
            self._stop.wait(SAMPLE_SECONDS)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._conn.close()


def _dbname(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


def _end_sessions(admin_dsn: str, dbname: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        )


@contextlib.contextmanager
def _path(server: PostgresServer, dsn: str, scenario: Scenario) -> Iterator[str]:
    """The DSN the runs connect with: the database itself, or through PgBouncer."""
    if scenario.path == "direct":
        yield psycopg.conninfo.make_conninfo(dsn, connect_timeout="10")
        return
    settings = {
        "query_wait_timeout": str(scenario.query_wait_timeout),
        # 128 by default: N clients connecting at once overflow it, and the kernel's SYN
        # retries (1 s, 3 s, 7 s) then look like a slow pooler.
        "listen_backlog": str(max(128, 3 * scenario.runs)),
        "max_client_conn": str(3 * scenario.runs + 100),  # lock, work and ledger sessions
    }
    with pgbouncer.run_pgbouncer(
        server, "transaction", pool_size=scenario.pool_size, settings=settings
    ) as bouncer:
        yield psycopg.conninfo.make_conninfo(bouncer.dsn(_dbname(dsn)), connect_timeout="10")


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


def run_cell(server: PostgresServer, remote: AccountingService, scenario: Scenario) -> Cell:
    """Run one cell on ``server`` (a fresh database of its own), effects to ``remote``."""
    cell = Cell(scenario)
    cell.unavailable = lock_mode_available(scenario.lock_mode)
    if cell.unavailable:
        return cell
    prefix = f"scale-{uuid.uuid4().hex[:8]}:"
    before = remote.stats()
    with temporary_database(server, "bench_scale") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ensure_schema(conn)
            conn.execute("CREATE TABLE public.scale_work (run_key text NOT NULL)")
        dbname = _dbname(dsn)
        with _Sampler(server.admin_dsn, dbname) as sampler:
            with _path(server, dsn, scenario) as target:
                outcomes, began, t0 = _run_threads(scenario, target, remote.url, prefix, cell)
                if cell.timed_out:  # end what still waits: its errors end its threads
                    _end_sessions(server.admin_dsn, dbname)
            if cell.timed_out:
                _end_sessions(server.admin_dsn, dbname)
                _join_stragglers(cell)
        cell.peak_server_connections = sampler.peak
        ended = _tally(cell, dict(outcomes), dict(began), t0)
        with psycopg.connect(dsn) as conn:
            counts: dict[str, int] = dict(conn.execute(
                "SELECT run_key, count(*) FROM public.scale_work GROUP BY run_key"
            ).fetchall())  # fmt: skip
        cell.keys_once = sum(1 for n in counts.values() if n == 1)
        cell.keys_repeated = sum(1 for n in counts.values() if n > 1)
        completed = {_run_key(i) for i, o in ended.items() if o.error is None}
        cell.keys_of_failed_runs = len(set(counts) - completed)
    exporters_done = sum(1 for i, o in ended.items() if o.error is None and scenario.exports(i))
    cell.effects_expected = exporters_done * scenario.effects_per_export
    cell.effects_delivered = len(remote.invoices(prefix))
    after = remote.stats()
    cell.remote_requests = after["requests"] - before["requests"]
    cell.remote_replays = after["replays"] - before["replays"]
    return cell


_THREADS: dict[int, list[threading.Thread]] = {}  # a timed-out cell's threads, by id(cell)


def _run_threads(
    scenario: Scenario, dsn: str, url: str, prefix: str, cell: Cell
) -> tuple[dict[int, Outcome], dict[int, float], float]:
    outcomes: dict[int, Outcome] = {}
    began: dict[int, float] = {}
    go = threading.Event()
    environment = RunEnvironment(logger=_QUIET)
    mode = _mode_kwargs(scenario.lock_mode)

    def one(index: int) -> None:
        go.wait()
        t = time.monotonic()
        spent: float | None = None
        error: BaseException | None = None
        try:
            run_idempotently(
                connect=lambda: psycopg.connect(dsn),
                job_name=JOB,
                run_key=_run_key(index),
                work=_work(scenario, index, url, prefix, began),
                environment=environment,
                **mode,
            )
        except BaseException as exc:  # every failure is a result of the cell
            error = exc
        end = time.monotonic()
        if index in began and error is None:
            spent = end - began[index]
        outcomes[index] = Outcome(end - t, spent, error, end)

    old_stack = threading.stack_size(THREAD_STACK)
    try:
        threads = [
            threading.Thread(target=one, args=(i,), name=f"scale-run-{i}", daemon=True)
            for i in range(scenario.runs)
        ]
        for thread in threads:
            thread.start()
    finally:
        threading.stack_size(old_stack)
    t0 = time.monotonic()
    go.set()
    deadline = t0 + scenario.bound
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    cell.wall_seconds = time.monotonic() - t0
    alive = [t for t in threads if t.is_alive()]
    if alive:
        cell.timed_out = True
        cell.waiting_in = _where_waiting(alive)
        _THREADS[id(cell)] = alive
    return outcomes, began, t0


def _where_waiting(threads: list[threading.Thread]) -> Counter[str]:
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


def _run_key(index: int) -> str:
    return f"k{index:05d}"


def _join_stragglers(cell: Cell) -> None:
    deadline = time.monotonic() + GRACE_SECONDS
    threads = _THREADS.pop(id(cell), [])
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    cell.stragglers = sum(1 for t in threads if t.is_alive())


def _tally(
    cell: Cell, outcomes: dict[int, Outcome], began: dict[int, float], t0: float
) -> dict[int, Outcome]:
    """Count the runs that ended within the bound; return them."""
    # A run that ended after the bound counts as unfinished: the cell did not wait for it.
    bound_end = t0 + cell.wall_seconds
    ended = {i: o for i, o in outcomes.items() if o.ended <= bound_end + 1e-3}
    cell.unfinished = cell.scenario.runs - len(ended)
    failures = sorted((o for o in ended.values() if o.error is not None), key=lambda o: o.ended)
    cell.completed = len(ended) - len(failures)
    cell.failed = len(failures)
    for o in failures:
        cell.errors[type(o.error).__name__] += 1
    if failures:
        first = failures[0].error
        text = " ".join(str(first).split())
        cell.first_error = f"{type(first).__name__}: {text[:120]}"
    cell.overhead_ms = [
        (o.seconds - o.work_seconds) * 1000
        for o in ended.values()
        if o.error is None and o.work_seconds is not None
    ]
    if began:
        cell.start_spread_ms = (max(began.values()) - t0) * 1000
    return ended


# ---------------------------------------------------------------- the benchmark


@contextlib.contextmanager
def scale_server(server: PostgresServer) -> Iterator[tuple[PostgresServer, str]]:
    """A PostgreSQL of ``max_connections`` 100 for the cells: a dedicated one from the
    system's binaries, else (none installed) the shared server, said in the note."""
    if system_binaries() is not None:
        with dedicated_cluster("scale", {"max_connections": str(MAX_CONNECTIONS)}) as own:
            yield own, f"a dedicated PostgreSQL, max_connections {MAX_CONNECTIONS}"
        return
    with psycopg.connect(server.admin_dsn) as conn:
        row = conn.execute("SHOW max_connections").fetchone()
    yield (
        server,
        f"the shared server (no system binaries), max_connections {row[0] if row else '?'}",
    )


def scenarios(counts: tuple[int, ...], work_seconds: float = WORK_SECONDS) -> list[Scenario]:
    return [
        Scenario(n, mode, path, work_seconds=work_seconds)
        for n in counts
        for path in PATHS
        for mode in LOCK_MODES
    ]


def run(size: Size, server: PostgresServer) -> BenchResult:
    result = BenchResult("scale", TITLE)
    result.notes.append(f"load average at start: {load_average()}")
    cells: list[Cell] = []
    with (
        temporary_database(server, "bench_scale_remote") as remote_dsn,
        run_accounting_service(remote_dsn) as remote,
        scale_server(server) as (target, where),
    ):
        for scenario in scenarios(size.scale_runs):
            say(f"scale: {scenario.label} (bound {scenario.bound:.0f} s) ...")
            cell = run_cell(target, remote, scenario)
            say(f"scale: {cell.summary()}")
            cells.append(cell)
    for cell in cells:
        _rows(result, cell)
    result.notes.append(
        f"Each cell on {where}; runs are threads of one process released together; work "
        f"sleeps {WORK_SECONDS:g} s outside any "
        "transaction, then writes one row through run.transaction(); every third run then "
        "sends 10 effects through the ledger (concurrency 2) to the accounting service. "
        "Through PgBouncer: pool_mode transaction, default_pool_size 20, query_wait_timeout "
        "60 s. The goal (issue 32): 1,000 runs through pool 20 all complete, each key's work "
        "once, no effect twice, peak server connections <= 20."
    )
    result.notes.append("\n".join(f"- {cell.summary()}" for cell in cells))
    # The same in real Airflow (bench/scale_airflow.py: its own stack, pooler and notes).
    scale_airflow.add_rows(result, scale_airflow.run_cells(server, scale_airflow.sized(size)))
    result.notes.append(f"load average at end: {load_average()}")
    return result


def _rows(result: BenchResult, cell: Cell) -> None:
    s = cell.scenario
    label = cell.scenario.label
    if cell.unavailable:
        result.add(f"{label}: completed", None, "runs", note=f"not available: {cell.unavailable}")
        return
    goal = s.path == "pgbouncer"  # the goal is stated for the pooler
    result.add(
        f"{label}: completed",
        cell.completed,
        "runs",
        f"= {s.runs}" if goal else "",
        (cell.completed == s.runs) if goal else None,
        (
            f"{cell.failed} failed ({cell.error_counts()}), first {cell.first_error}"
            if cell.failed
            else "none failed"
        )
        + (
            f"; {cell.unfinished} still running at the {s.bound:.0f} s bound"
            if cell.timed_out
            else ""
        ),
    )
    result.add(
        f"{label}: keys whose work committed once",
        cell.keys_once,
        "keys",
        note=f"{cell.keys_repeated} more than once; {cell.keys_of_failed_runs} of runs that "
        "did not complete (failed or still running after their work committed)",
    )
    result.add(
        f"{label}: effects at the remote",
        cell.effects_delivered,
        "effects",
        f"= {cell.effects_expected}",
        cell.effects_delivered == cell.effects_expected,
        f"expected: completed exporting runs x {s.effects_per_export}; "
        f"{cell.remote_requests} requests, {cell.remote_replays} replays",
    )
    result.add(
        f"{label}: peak server connections",
        cell.peak_server_connections,
        "",
        f"<= {s.pool_size}" if goal else "",
        at_most(cell.peak_server_connections, s.pool_size) if goal else None,
        f"pg_stat_activity of the database, every {SAMPLE_SECONDS * 1000:.0f} ms",
    )
    result.add(f"{label}: wall time", cell.wall_seconds, "s", note=f"bound {s.bound:.0f} s")
    if cell.overhead_ms:
        result.add(
            f"{label}: overhead per completed run, median",
            median(cell.overhead_ms),
            "ms",
            note=f"p99 {percentile(cell.overhead_ms, 99):.0f} ms; call minus its work; "
            f"last work began {cell.start_spread_ms:.0f} ms after the release",
        )
