"""Scale: N idempotent runs at once on one PostgreSQL of ``max_connections`` 100 (issue 32).

Each run is a thread calling the public API,
``run_idempotently(connect=..., job_name=..., run_key=..., work=...)``, all released by one
event: threads of this process, or spread over K processes (``Scenario.processes``; the
benchmark's default 4, ``--scale-processes``; bench/scale_drivers.py). Its work sleeps (``work_seconds``, outside any transaction), then writes one row of
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
of server connections to the cell's database (its client backends in pg_stat_activity sampled
every 50 ms, not an autovacuum worker, without a backend the pooler had already closed:
``_Sampler``), the wall
time and the overhead per completed run (the call's time minus the time inside its work).

The benchmark starts a PostgreSQL of its own (the system's binaries, ``max_connections``
100: the figure of the issue, whatever the shared server has) so that a thousand clients
never crowd the server other work uses; the accounting service keeps its data on the shared
server. tests/integration/test_scale.py runs the same cells at a small N.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import inspect
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import psycopg

from airflow_idempotency import run_idempotently
from airflow_idempotency.schema import ensure_schema
from bench import scale_airflow
from bench.common import BenchResult, Size, at_most, load_average, median, percentile, say
from bench.scale_drivers import Driven, Outcome, drive, error_name, run_key
from devtools import pgbouncer
from devtools.accounting import AccountingService, run_accounting_service
from devtools.postgres import (
    PostgresServer,
    dedicated_cluster,
    system_binaries,
    temporary_database,
)

TITLE = "Scale: N runs at once, direct and through a transaction pooler (issue 32)"
LOCK_MODES = ("advisory", "lease")
PATHS = ("direct", "pgbouncer")
MAX_CONNECTIONS = 100
POOL_SIZE = 20
EXPORT_EVERY = 3  # every third run sends effects
WORK_SECONDS = 2.0
SAMPLE_SECONDS = 0.05
GRACE_SECONDS = 30.0  # after a cell's bound: its sessions are ended, its threads get this long
PROCESSES = 4  # driver processes of a benchmark cell (bench/scale_drivers.py)


@dataclass(frozen=True)
class Scenario:
    """One cell: how many runs, which lock mode, which path, and the sizes around them."""

    runs: int
    lock_mode: str
    path: str
    pool_size: int = POOL_SIZE
    work_seconds: float = WORK_SECONDS
    effects_per_export: int = 10
    # PgBouncer's: how long a client waits for a server connection; half the default lease_ttl
    # (30 s), as docs/deploying.md asks of the lease mode
    query_wait_timeout: int = 15
    bound_seconds: float | None = None  # default: see ``bound``
    processes: int = 1  # the runs are threads of this process, or of this many processes

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
    listed_peak: int = 0  # with the backends the pooler had closed, still exiting
    at_peak: list[str] = field(default_factory=list)  # the backends listed at that peak
    exiting_at_peak: list[str] = field(default_factory=list)  # of them, closed by the pooler

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
            f"peak server connections {self.peak_server_connections}"
            + (
                f" (listed {self.listed_peak}: with backends the pooler had closed, exiting)"
                if self.listed_peak > self.peak_server_connections
                else ""
            )
            + "; "
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


# ---------------------------------------------------------------- one cell


class _Sampler:
    """The peak of server connections to one database, read every ``SAMPLE_SECONDS`` from a
    session in another database (so it never counts itself).

    A backend whose connection the pooler has already closed is still listed while its
    process exits (a few ms), and PgBouncer opens the replacement at once: counted, it makes
    the sample one over the pool. :meth:`settle` takes those out of each sample, by the
    pooler's own log (which connection, by its local port, it closed when); ``raw_peak`` is
    the count with them, ``at_peak`` what was listed then (one line per backend) and
    ``exiting`` which of them the pooler had closed before that sample.
    """

    def __init__(self, admin_dsn: str, dbname: str) -> None:
        self.peak = self.raw_peak = 0
        self.at_peak: list[str] = []
        self.exiting: list[str] = []
        # (server time, {pid: (client_port, backend_start, what it was)}) per sample
        self.samples: list[tuple[float, dict[int, tuple[int, float, str]]]] = []
        self._dbname = dbname
        self._stop = threading.Event()
        self._conn = psycopg.connect(admin_dsn, autocommit=True)
        self._thread = threading.Thread(target=self._loop, name="scale-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            rows = self._conn.execute(_SAMPLE, (self._dbname,)).fetchall()
            at = float(rows[0][0]) if rows else 0.0
            backends = {
                int(r[1]): (int(r[2] or 0), float(r[3]), " ".join(map(str, (*r[1:3], *r[4:]))))
                for r in rows
            }
            self.samples.append((at, backends))
            self._stop.wait(SAMPLE_SECONDS)

    def settle(self, closed: dict[int, list[float]]) -> None:
        """The peaks, without the backends the pooler closed (``closed``: local port -> when)
        before each sample."""
        for at, backends in self.samples:
            gone = [
                pid
                for pid, (port, start, _) in backends.items()
                if any(start <= when <= at for when in closed.get(port, ()))
            ]
            self.peak = max(self.peak, len(backends) - len(gone))
            if len(backends) > self.raw_peak:
                self.raw_peak = len(backends)
                self.at_peak = sorted(line for _, _, line in backends.values())
                self.exiting = sorted(backends[pid][2] for pid in gone)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._conn.close()


_SAMPLE = (
    "SELECT extract(epoch FROM clock_timestamp()), pid, client_port,"
    " extract(epoch FROM backend_start), backend_type, coalesce(application_name, ''), state,"
    " to_char(backend_start, 'HH24:MI:SS.MS'), to_char(state_change, 'HH24:MI:SS.MS'),"
    " coalesce(wait_event, '-'), left(regexp_replace(query, '\\s+', ' ', 'g'), 60)"
    " FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'"
)
_POOLER_LINE = re.compile(
    r"^(\S+ \S+) \S+ \[\d+\] \w+ (S-0x[0-9a-f]+): "
    r"(?:.*new connection to server \(from [^)]*:(\d+)\)|.*closing because)"
)


def pooler_closes(log: str) -> dict[int, list[float]]:
    """When PgBouncer closed each server connection, by its local port (the backend's
    ``client_port``), from its log (``log_connections``/``log_disconnections``, on by
    default; its times are this machine's local time)."""
    ports: dict[str, int] = {}
    closed: dict[int, list[float]] = {}
    for line in log.splitlines():
        match = _POOLER_LINE.match(line)
        if match is None:
            continue
        stamp, server, port = match.groups()
        if port is not None:
            ports[server] = int(port)
        elif server in ports:
            when = dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp()
            closed.setdefault(ports.pop(server), []).append(when)
    return closed


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
def _path(server: PostgresServer, dsn: str, scenario: Scenario, logs: list[str]) -> Iterator[str]:
    """The DSN the runs connect with: the database itself, or through PgBouncer (its log
    appended to ``logs`` when it stops)."""
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
        try:
            yield psycopg.conninfo.make_conninfo(bouncer.dsn(_dbname(dsn)), connect_timeout="10")
        finally:
            logs.append(bouncer.log_text())


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
        logs: list[str] = []
        with _Sampler(server.admin_dsn, dbname) as sampler:
            with _path(server, dsn, scenario, logs) as target:
                driven = drive(scenario, target, remote.url, prefix)
                if driven.timed_out:  # end what still waits: its errors end its threads
                    _end_sessions(server.admin_dsn, dbname)
            if driven.timed_out:
                _end_sessions(server.admin_dsn, dbname)
                cell.stragglers = driven.finish(time.monotonic() + GRACE_SECONDS)
        sampler.settle(pooler_closes("".join(logs)))
        cell.peak_server_connections = sampler.peak
        cell.listed_peak = sampler.raw_peak
        cell.at_peak, cell.exiting_at_peak = sampler.at_peak, sampler.exiting
        ended = _tally(cell, driven)
        with psycopg.connect(dsn) as conn:
            counts: dict[str, int] = dict(conn.execute(
                "SELECT run_key, count(*) FROM public.scale_work GROUP BY run_key"
            ).fetchall())  # fmt: skip
        cell.keys_once = sum(1 for n in counts.values() if n == 1)
        cell.keys_repeated = sum(1 for n in counts.values() if n > 1)
        completed = {run_key(i) for i, o in ended.items() if o.error is None}
        cell.keys_of_failed_runs = len(set(counts) - completed)
    exporters_done = sum(1 for i, o in ended.items() if o.error is None and scenario.exports(i))
    cell.effects_expected = exporters_done * scenario.effects_per_export
    cell.effects_delivered = len(remote.invoices(prefix))
    after = remote.stats()
    cell.remote_requests = after["requests"] - before["requests"]
    cell.remote_replays = after["replays"] - before["replays"]
    return cell


def _tally(cell: Cell, driven: Driven) -> dict[int, Outcome]:
    """Count the runs that ended within the bound; return them."""
    cell.wall_seconds = driven.wall_seconds
    cell.timed_out = driven.timed_out
    cell.waiting_in = driven.waiting_in
    # A run that ended after the bound counts as unfinished: the cell did not wait for it.
    bound_end = driven.t0 + cell.wall_seconds
    ended = {i: o for i, o in dict(driven.outcomes).items() if o.ended <= bound_end + 1e-3}
    cell.unfinished = cell.scenario.runs - len(ended)
    failures = sorted((o for o in ended.values() if o.error is not None), key=lambda o: o.ended)
    cell.completed = len(ended) - len(failures)
    cell.failed = len(failures)
    errors = [o.error for o in failures if o.error is not None]
    cell.errors.update(error_name(error) for error in errors)
    if errors:
        text = " ".join(str(errors[0]).split())
        cell.first_error = f"{error_name(errors[0])}: {text[:120]}"
    cell.overhead_ms = [
        (o.seconds - o.work_seconds) * 1000
        for o in ended.values()
        if o.error is None and o.work_seconds is not None
    ]
    began = dict(driven.began)
    if began:
        cell.start_spread_ms = (max(began.values()) - driven.t0) * 1000
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


def scenarios(
    counts: tuple[int, ...], work_seconds: float = WORK_SECONDS, processes: int = PROCESSES
) -> list[Scenario]:
    return [
        Scenario(n, mode, path, work_seconds=work_seconds, processes=min(processes, n))
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
        for scenario in scenarios(size.scale_runs, processes=size.scale_processes):
            say(f"scale: {scenario.label} (bound {scenario.bound:.0f} s) ...")
            cell = run_cell(target, remote, scenario)
            say(f"scale: {cell.summary()}")
            cells.append(cell)
    for cell in cells:
        _rows(result, cell)
    result.notes.append(
        f"Each cell on {where}; runs are threads of {size.scale_processes} process(es) "
        "(about N / that many threads each), released together by one event; work "
        f"sleeps {WORK_SECONDS:g} s outside any "
        "transaction, then writes one row through run.transaction(); every third run then "
        "sends 10 effects through the ledger (concurrency 2) to the accounting service. "
        "Through PgBouncer: pool_mode transaction, default_pool_size 20, query_wait_timeout "
        f"{Scenario(1, 'lease', 'pgbouncer').query_wait_timeout} s (at most half the "
        "lease_ttl, docs/deploying.md). The goal (issue 32): 1,000 runs through pool 20 all complete, each key's work "
        "once, no effect twice, peak server connections <= 20."
    )
    result.notes.append("\n".join(f"- {cell.summary()}" for cell in cells))
    result.notes.extend(_peak_notes(cells))
    # The same in real Airflow (bench/scale_airflow.py: its own stack, pooler and notes).
    scale_airflow.add_rows(result, scale_airflow.run_cells(server, scale_airflow.sized(size)))
    result.notes.append(f"load average at end: {load_average()}")
    return result


def _peak_notes(cells: list[Cell]) -> list[str]:
    """The server connections of a pooled cell whose peak passed its pool: what they were."""
    notes = []
    for cell in cells:
        s = cell.scenario
        if s.path != "pgbouncer" or cell.listed_peak <= s.pool_size:
            continue
        notes.append(
            f"{s.label}: pg_stat_activity listed {cell.listed_peak} backends at most (pid, "
            "client_port, backend_type, application_name, state, backend_start, state_change, "
            "wait_event, query):\n"
            + "\n".join(f"    {line}" for line in cell.at_peak)
            + "\n  of them closed by the pooler before that sample, still exiting: "
            + ("; ".join(cell.exiting_at_peak) or "none")
        )
    return notes


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
        f"client backends of the database in pg_stat_activity, every {SAMPLE_SECONDS * 1000:.0f} "
        f"ms (no autovacuum worker), without backends the pooler had already closed (still exiting; with them: {cell.listed_peak})",
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
