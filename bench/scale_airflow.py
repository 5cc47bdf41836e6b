"""Scale in real Airflow: N idempotent tasks at once through a small PgBouncer pool (issue 32).

A real Airflow 3 stack (``devtools.airflow_stack``: api-server, scheduler, dag-processor,
LocalExecutor with ``parallelism`` = N, its metadata in a PostgreSQL database) runs one DAG run
of ``bench/dags_scale/scale_airflow.py``: one ``IdempotentRunOperator`` mapped over N segments,
each its own run key, whose work sleeps and then writes one row through ``run.transaction()``.
The job database is reached only through a PgBouncer in ``pool_mode = transaction`` with
``default_pool_size`` = ``pool_size`` (10); the lock mode comes from the Airflow connection's
extra (``{"lock_mode": "lease"}``), as an operator would set it (docs/deploying.md).

Measured per cell: the task instances' states, rows per key (each key's work committed once),
the attempt rows per key (``completed`` once), the peak of server connections to the job
database (``pg_stat_activity`` every 50 ms from a session in another database), the peak of
tasks inside their work at once (from the rows' began/ended), how long clients waited for a
server connection in the pooler (``SHOW STATS`` total_wait_time, ``SHOW POOLS`` maxwait and
cl_waiting sampled with the connections), each task's time outside its work (task instance
duration minus its work) and the load average at the start and the end.

``bench.scale`` adds these cells' rows to the scale benchmark; tests/stack/test_scale_airflow.py
runs the lease cell as a test.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from airflow_idempotency.schema import ensure_schema
from bench.common import BenchResult, Size, at_most, load_average, median, say
from devtools import airflow_env, pgbouncer
from devtools.airflow_stack import AirflowStack, StackError, airflow_stack
from devtools.postgres import PostgresServer, temporary_database

DAGS_FOLDER = Path(__file__).resolve().parent / "dags_scale"
RUN_DATE = "2026-10-01"
SAMPLE_SECONDS = 0.05


@dataclass(frozen=True)
class AirflowScenario:
    """One cell: N mapped tasks of one DAG run, one lock mode, one pool."""

    tasks: int = 40
    lock_mode: str = "lease"
    pool_size: int = 10
    work_seconds: float = 20.0
    # PgBouncer's: how long a client waits for a server connection (lease mode: at most
    # half the lease_ttl, docs/deploying.md)
    query_wait_timeout: int = 15
    bound_seconds: float = 240.0  # trigger to the run's end

    @property
    def dag_id(self) -> str:
        return f"scale_airflow_{self.lock_mode}"

    @property
    def label(self) -> str:
        return (
            f"Airflow LocalExecutor, {self.tasks} tasks, pgbouncer pool {self.pool_size}, "
            f"{self.lock_mode}"
        )


@dataclass
class AirflowCell:
    """What one cell measured."""

    scenario: AirflowScenario
    run_state: str = ""
    error: str = ""  # the run did not end within the bound, or the stack failed
    task_states: Counter[str] = field(default_factory=Counter)
    rows_per_key: dict[str, int] = field(default_factory=dict)
    completed_per_key: dict[str, int] = field(default_factory=dict)
    attempts: Counter[str] = field(default_factory=Counter)  # attempt outcomes
    peak_server_connections: int = 0
    peak_working: int = 0  # tasks inside their work at once
    peak_clients_waiting: int = 0  # PgBouncer's cl_waiting, sampled
    max_wait_seconds: float = 0.0  # PgBouncer's maxwait (the oldest waiting client), sampled
    total_wait_seconds: float = 0.0  # PgBouncer's total_wait_time of the job database
    wall_seconds: float = 0.0  # trigger to the run's end
    start_spread_seconds: float = 0.0  # the first task's work began -> the last's
    worked_seconds: dict[str, float] = field(default_factory=dict)  # per key, inside its work
    outside_work_seconds: list[float] = field(default_factory=list)  # per task
    load_start: str = ""
    load_end: str = ""

    @property
    def succeeded(self) -> int:
        return self.task_states.get("success", 0)

    @property
    def keys_once(self) -> int:
        return sum(1 for n in self.rows_per_key.values() if n == 1)

    @property
    def keys_completed_once(self) -> int:
        return sum(1 for n in self.completed_per_key.values() if n == 1)

    @property
    def all_completed_once(self) -> bool:
        n = self.scenario.tasks
        return (
            self.succeeded == n
            and self.keys_once == n == len(self.rows_per_key)
            and self.keys_completed_once == n == len(self.completed_per_key)
        )

    def summary(self) -> str:
        states = ", ".join(f"{s} {n}" for s, n in sorted(self.task_states.items()))
        outside = median(self.outside_work_seconds) if self.outside_work_seconds else 0.0
        return (
            f"{self.scenario.label}: run {self.run_state or '?'}"
            + (f" ({self.error})" if self.error else "")
            + f"; tasks {states or 'none'}; keys written once {self.keys_once}, "
            f"completed once {self.keys_completed_once}; attempts {dict(self.attempts)}; "
            f"peak server connections {self.peak_server_connections}; peak tasks in their "
            f"work at once {self.peak_working}; pooler waits: total "
            f"{self.total_wait_seconds:.1f} s, longest {self.max_wait_seconds:.1f} s, peak "
            f"clients waiting {self.peak_clients_waiting}; wall {self.wall_seconds:.1f} s, "
            f"work began over {self.start_spread_seconds:.1f} s, median time outside the "
            f"work {outside:.1f} s; load {self.load_start} -> {self.load_end}"
        )


# ---------------------------------------------------------------- sampling


def _admin(bouncer: pgbouncer.PgBouncer) -> psycopg.Connection[Any]:
    """PgBouncer's admin console (simple query protocol only: a client-side cursor)."""
    return psycopg.connect(
        bouncer.dsn("pgbouncer"), autocommit=True, cursor_factory=psycopg.ClientCursor
    )


def _pooler_rows(conn: psycopg.Connection[Any], command: str, dbname: str) -> dict[str, Any]:
    cur = conn.execute(command)
    names = [d.name for d in cur.description or ()]
    for values in cur.fetchall():
        row = dict(zip(names, values, strict=True))
        if row.get("database") == dbname:
            return row
    return {}


class _Sampler:
    """Every ``SAMPLE_SECONDS``: server connections to ``dbname`` (from another database) and
    the pooler's waiting clients and longest wait for it."""

    def __init__(self, admin_dsn: str, bouncer: pgbouncer.PgBouncer, dbname: str) -> None:
        self.peak = self.peak_waiting = 0
        self.max_wait = 0.0
        self._dbname = dbname
        self._stop = threading.Event()
        self._conn = psycopg.connect(admin_dsn, autocommit=True)
        self._pooler = _admin(bouncer)
        self._thread = threading.Thread(target=self._loop, name="scale-airflow", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            row = self._conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = %s AND backend_type = 'client backend'",
                (self._dbname,),
            ).fetchone()
            self.peak = max(self.peak, int(row[0]) if row else 0)
            pool = _pooler_rows(self._pooler, "SHOW POOLS", self._dbname)
            self.peak_waiting = max(self.peak_waiting, int(pool.get("cl_waiting") or 0))
            wait = float(pool.get("maxwait") or 0) + float(pool.get("maxwait_us") or 0) / 1e6
            self.max_wait = max(self.max_wait, wait)
            self._stop.wait(SAMPLE_SECONDS)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._conn.close()
        self._pooler.close()


# ---------------------------------------------------------------- one cell


def _dbname(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


def _job_database(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_schema(conn)
        conn.execute(
            "CREATE TABLE public.scale_work"
            " (run_key text NOT NULL, began timestamptz NOT NULL, ended timestamptz NOT NULL)"
        )


def _connection(bouncer: pgbouncer.PgBouncer, dbname: str, mode: str) -> str:
    """The Airflow connection of a job database through the pooler, its lock mode in the extra."""
    conn = json.loads(airflow_env.airflow_connection_json(bouncer.dsn(dbname)))
    conn["extra"] = {"lock_mode": mode}
    return json.dumps(conn)


def _stack_env(scenario: AirflowScenario, connections: dict[str, str]) -> dict[str, str]:
    env = {f"AIRFLOW_CONN_SCALE_{mode.upper()}": c for mode, c in connections.items()}
    return {
        **env,
        "SCALE_AIRFLOW_TASKS": str(scenario.tasks),
        "SCALE_AIRFLOW_WORK_SECONDS": str(scenario.work_seconds),
        # Every task at once: the executor's processes, the scheduler's slots, the pool's.
        "AIRFLOW__CORE__PARALLELISM": str(scenario.tasks),
        "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(scenario.tasks),
        "AIRFLOW__CORE__DEFAULT_POOL_TASK_SLOT_COUNT": str(max(128, scenario.tasks)),
        "AIRFLOW__SCHEDULER__MAX_TIS_PER_QUERY": str(scenario.tasks),
    }


@contextlib.contextmanager
def airflow_scale_stack(
    server: PostgresServer, scenarios: list[AirflowScenario], home: Path
) -> Iterator[tuple[AirflowStack, pgbouncer.PgBouncer, dict[str, str]]]:
    """A stack whose connections ``scale_lease`` / ``scale_advisory`` reach a job database
    each through one PgBouncer (transaction mode, the first scenario's pool and wait); the
    job databases' DSNs (direct) by lock mode."""
    first = scenarios[0]
    settings = {"query_wait_timeout": str(first.query_wait_timeout), "max_client_conn": "1000"}
    with contextlib.ExitStack() as es:
        jobs = {
            s.lock_mode: es.enter_context(temporary_database(server, f"scale_af_{s.lock_mode}"))
            for s in scenarios
        }
        for dsn in jobs.values():
            _job_database(dsn)
        meta = es.enter_context(temporary_database(server, "scale_af_airflow"))
        bouncer = es.enter_context(
            pgbouncer.run_pgbouncer(server, "transaction", first.pool_size, settings)
        )
        connections = {m: _connection(bouncer, _dbname(d), m) for m, d in jobs.items()}
        env = _stack_env(first, connections)
        stack = es.enter_context(
            airflow_stack(home, DAGS_FOLDER, env, metadata_dsn=meta, start_timeout=240)
        )
        yield stack, bouncer, jobs


def run_airflow_cell(
    server: PostgresServer,
    stack: AirflowStack,
    bouncer: pgbouncer.PgBouncer,
    job_dsn: str,
    scenario: AirflowScenario,
) -> AirflowCell:
    """Trigger the scenario's DAG once on the running stack and measure it."""
    cell = AirflowCell(scenario, load_start=load_average())
    dbname = _dbname(job_dsn)
    stack.unpause(scenario.dag_id)
    with _admin(bouncer) as admin:
        waited_before = _pooler_rows(admin, "SHOW STATS", dbname).get("total_wait_time") or 0
    with _Sampler(server.admin_dsn, bouncer, dbname) as sampler:
        t0 = time.monotonic()
        try:
            run = stack.trigger(scenario.dag_id, RUN_DATE, timeout=scenario.bound_seconds)
            cell.run_state = run.state or ""
        except StackError as exc:
            cell.error = " ".join(str(exc).split())[:300]
            run = None
        cell.wall_seconds = time.monotonic() - t0
    stack.pause(scenario.dag_id)
    cell.peak_server_connections = sampler.peak
    cell.peak_clients_waiting = sampler.peak_waiting
    cell.max_wait_seconds = sampler.max_wait
    with _admin(bouncer) as admin:
        waited = _pooler_rows(admin, "SHOW STATS", dbname).get("total_wait_time") or 0
    cell.total_wait_seconds = (int(waited) - int(waited_before)) / 1e6
    _read_job_database(cell, job_dsn)
    if run is not None:
        _read_task_instances(cell, stack, run.run_id)
    cell.load_end = load_average()
    return cell


def _read_job_database(cell: AirflowCell, dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        work = conn.execute("SELECT run_key, began, ended FROM public.scale_work").fetchall()
        attempts = conn.execute(
            "SELECT run_key, outcome FROM idempotency.job_run_attempts"
        ).fetchall()
    cell.rows_per_key = dict(Counter(key for key, _, _ in work))
    cell.attempts = Counter(outcome for _, outcome in attempts)
    cell.completed_per_key = dict(Counter(k for k, o in attempts if o == "completed"))
    events = sorted([(b, 1) for _, b, _ in work] + [(e, -1) for _, _, e in work])
    inside = 0
    for _, step in events:
        inside += step
        cell.peak_working = max(cell.peak_working, inside)
    if work:
        began = [b for _, b, _ in work]
        cell.start_spread_seconds = (max(began) - min(began)).total_seconds()
    cell.worked_seconds = {key: (e - b).total_seconds() for key, b, e in work}


def _read_task_instances(cell: AirflowCell, stack: AirflowStack, run_id: str) -> None:
    rows = stack.query(
        "SELECT map_index, state, start_date, end_date FROM task_instance"
        " WHERE dag_id = ? AND run_id = ?",
        (cell.scenario.dag_id, run_id),
    )
    cell.task_states = Counter(str(r["state"]) for r in rows)
    worked = cell.worked_seconds
    for r in rows:
        key = f"s{int(r['map_index']):02d}|{RUN_DATE}"
        if r["start_date"] is not None and r["end_date"] is not None and key in worked:
            span = (r["end_date"] - r["start_date"]).total_seconds()
            cell.outside_work_seconds.append(span - worked[key])


# ---------------------------------------------------------------- the benchmark's rows


def sized(size: Size) -> list[AirflowScenario]:
    """The cells of a benchmark size: at ``tiny`` (the smoke test) 6 lease-mode tasks through
    a pool of 2; otherwise 40 tasks through a pool of 10 in the lease mode, then the advisory
    mode through the same pool for comparison."""
    if size.name == "tiny":
        return [AirflowScenario(6, "lease", 2, work_seconds=3.0, bound_seconds=120)]
    return [AirflowScenario(40, mode, 10) for mode in ("lease", "advisory")]


def run_cells(server: PostgresServer, scenarios: list[AirflowScenario]) -> list[AirflowCell]:
    """Each scenario on one stack (every scenario shares the first one's pool and sizes)."""
    cells = []
    with (
        tempfile.TemporaryDirectory(prefix="idem-scale-airflow-") as home,
        airflow_scale_stack(server, scenarios, Path(home) / "home") as (stack, bouncer, jobs),
    ):
        for scenario in scenarios:
            say(f"scale: {scenario.label} ...")
            cell = run_airflow_cell(server, stack, bouncer, jobs[scenario.lock_mode], scenario)
            say(f"scale: {cell.summary()}")
            cells.append(cell)
    return cells


def add_rows(result: BenchResult, cells: list[AirflowCell]) -> None:
    """The Airflow cells' rows and notes in the scale benchmark's result."""
    for cell in cells:
        _cell_rows(result, cell)
    if not cells:
        return
    s = cells[0].scenario
    result.notes.append(
        "In real Airflow (bench/scale_airflow.py): an Airflow 3 stack (api-server, scheduler, "
        f"dag-processor; LocalExecutor, parallelism {s.tasks}; metadata in PostgreSQL) runs "
        f"one DAG run of an IdempotentRunOperator mapped over {s.tasks} segments, each its "
        f"own run key; each task's work sleeps {s.work_seconds:g} s, then writes one row "
        "through run.transaction(). The job database only through PgBouncer, pool_mode "
        f"transaction, default_pool_size {s.pool_size}, query_wait_timeout "
        f"{s.query_wait_timeout} s; the lock mode from the Airflow connection's extra. Goal "
        f"(issue 32): every task succeeds, each key's work once, server connections <= "
        f"{s.pool_size}. Waits: PgBouncer's own count of the time clients waited for a "
        "server connection."
    )
    result.notes.append("\n".join(f"- {cell.summary()}" for cell in cells))


def _cell_rows(result: BenchResult, cell: AirflowCell) -> None:
    s = cell.scenario
    goal = s.lock_mode == "lease"  # the goal; advisory is shown for comparison
    label = cell.scenario.label
    result.add(
        f"{label}: tasks succeeded, work once per key",
        min(cell.succeeded, cell.keys_once),
        "tasks",
        f"= {s.tasks}" if goal else "",
        cell.all_completed_once if goal else None,
        f"run {cell.run_state or '?'}; states "
        + ", ".join(f"{k} {n}" for k, n in sorted(cell.task_states.items()))
        + f"; keys written once {cell.keys_once}, completed once {cell.keys_completed_once}"
        + (f"; {cell.error}" if cell.error else ""),
    )
    result.add(
        f"{label}: peak server connections",
        cell.peak_server_connections,
        "",
        f"<= {s.pool_size}" if goal else "",
        at_most(cell.peak_server_connections, s.pool_size) if goal else None,
        f"pg_stat_activity of the job database every {SAMPLE_SECONDS * 1000:.0f} ms; "
        f"peak tasks inside their work at once {cell.peak_working}",
    )
    result.add(
        f"{label}: waited for a server connection, total",
        cell.total_wait_seconds,
        "s",
        note=f"PgBouncer SHOW STATS total_wait_time; longest single wait "
        f"{cell.max_wait_seconds:.2f} s, peak clients waiting {cell.peak_clients_waiting}",
    )
    result.add(
        f"{label}: wall time",
        cell.wall_seconds,
        "s",
        note=f"trigger to the run's end; work {s.work_seconds:g} s per task, began over "
        f"{cell.start_spread_seconds:.1f} s",
    )
    if cell.outside_work_seconds:
        result.add(
            f"{label}: time per task outside its work, median",
            median(cell.outside_work_seconds),
            "s",
            note=f"task instance duration minus its work; max "
            f"{max(cell.outside_work_seconds):.1f} s; load {cell.load_start} -> "
            f"{cell.load_end}",
        )
