"""What every benchmark shares: sizes, result rows, statistics, child processes, databases."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from devtools.postgres import PostgresServer, temporary_database

RESULT_PREFIX = "BENCH-RESULT "


@dataclass(frozen=True)
class Size:
    """How big each benchmark runs. ``full`` is the size the targets are stated for."""

    name: str
    overhead_runs: int  # run_idempotently calls per variant
    airflow_dates: int  # dates per backfill
    airflow_rounds: int  # timed passes per DAG (alternating plain / idempotent)
    airflow_warmup: bool  # an untimed warm-up pass of each DAG first
    invoice_orders: int  # orders of the one business date
    export_invoices: int  # invoices exported through the ledger
    export_bare_requests: int  # requests of each bare-client loop (one before, one after)
    export_shared_requests: int  # requests of the single-shared-AsyncClient loop (reference)
    export_concurrency: int
    contention_workers: int
    email_messages: int  # emails through the ledger, and through each plain smtplib loop
    scale_runs: tuple[int, ...] = (100, 500, 1_000)  # runs at once, one scale cell each
    scale_processes: int = 4  # the scale cells' runs are threads of this many processes


SIZES: dict[str, Size] = {
    "tiny": Size("tiny", 20, 1, 1, False, 2_000, 500, 200, 100, 32, 4, 200, (10,)),
    "small": Size("small", 300, 7, 1, True, 100_000, 10_000, 5_000, 1_000, 32, 32, 2_000, (100,)),
    "full": Size("full", 1_000, 30, 3, True, 1_000_000, 100_000, 20_000, 2_000, 32, 32, 10_000),
}


@dataclass
class Row:
    """One line of the results table."""

    bench: str
    figure: str
    value: float | None
    unit: str = ""
    target: str = ""
    ok: bool | None = None  # None: no target, a figure for the record
    note: str = ""

    @property
    def verdict(self) -> str:
        return {True: "ok", False: "MISSED", None: ""}[self.ok]

    def shown(self) -> str:
        if self.value is None:
            return "n/a"
        v = self.value
        if isinstance(v, int):  # a count: runs, keys, connections
            return f"{v:,}"
        if self.unit in ("x", "ratio"):
            return f"{v:.3f}"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"


@dataclass
class BenchResult:
    """The rows of one benchmark, its wall time and notes for BENCHMARKS.md."""

    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def add(self, *args: Any, **kwargs: Any) -> Row:
        row = Row(self.name, *args, **kwargs)
        self.rows.append(row)
        return row


def at_most(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def at_least(value: float | None, limit: float) -> bool | None:
    return None if value is None else value >= limit


# ---------------------------------------------------------------- statistics


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (p99 of 1,000 values is the 990th smallest)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-pct * len(ordered) // 100))))
    return float(ordered[rank - 1])


# ---------------------------------------------------------------- the machine


def machine_info(server: PostgresServer | None = None) -> dict[str, str]:
    """nproc, CPU model, RAM, Python, Postgres and library versions, load average."""
    info: dict[str, str] = {}
    info["nproc"] = str(
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    )
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    info["cpu"] = model
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal"):
                info["ram"] = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    info["os"] = f"{platform.system()} {platform.release()}"
    info["python"] = platform.python_version()
    if server is not None:
        with psycopg.connect(server.admin_dsn) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        info["postgres"] = f"{row[0] if row else '?'} ({server.source})"
    from importlib.metadata import version

    for dist in ("apache-airflow", "psycopg", "psycopg-pool", "httpx", "httpcore", "uvicorn"):
        with contextlib.suppress(Exception):
            info[dist] = version(dist)
    info["load average"] = load_average()
    return info


QUIET_LOAD = 2.0
"""A figure counts only from a machine whose 1-minute load average is below this at the
start and at the end of its benchmark."""


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


SETTLE_SECONDS = 180.0
"""How long a full-size benchmark waits, at its end, for the load average to settle."""


def settled_load_average(timeout: float = SETTLE_SECONDS) -> str:
    """The load average at a benchmark's end, read once its own processes have settled.

    The 1-minute average decays with a one-minute time constant, so right after an Airflow
    stack stops it still shows the stack's own load. This waits (at most ``timeout``
    seconds) for it to fall below :data:`QUIET_LOAD`; a machine where something else is
    running never gets there, and the figure says so. The wait is printed with the figure.
    """
    t0 = time.monotonic()
    while os.getloadavg()[0] >= QUIET_LOAD and time.monotonic() - t0 < timeout:
        time.sleep(5)
    return f"{load_average()} (read {time.monotonic() - t0:.0f} s after the benchmark's end)"


# ---------------------------------------------------------------- child processes


def peak_rss_mb() -> float:
    """This process's peak resident set size, in MB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(
    target: str, args: dict[str, Any], timeout: float = 1800, python: str = sys.executable
) -> dict[str, Any]:
    """Run ``module:function(**args)`` in a fresh interpreter (``python``: another line's);
    return its dict result.

    The child adds ``peak_rss_mb`` (its own ru_maxrss, so only the process doing the work
    is counted), ``child_seconds`` (the call, without interpreter start and imports of
    the child's entry point) and ``cpu_seconds`` (its CPU time, user + system, in the call).
    """
    proc = subprocess.run(
        [python, "-m", "bench.common", target, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
            return result
    raise RuntimeError(
        f"child {target} exited {proc.returncode} without a result\n"
        f"--- stdout:\n{proc.stdout[-3000:]}\n--- stderr:\n{proc.stderr[-5000:]}"
    )


def _child_main(argv: list[str]) -> None:
    target, raw = argv
    module_name, func_name = target.split(":")
    func: Callable[..., dict[str, Any]] = getattr(importlib.import_module(module_name), func_name)
    t0 = time.perf_counter()
    c0 = time.process_time()
    result = func(**json.loads(raw))
    result["child_seconds"] = time.perf_counter() - t0
    result["cpu_seconds"] = time.process_time() - c0
    result["peak_rss_mb"] = peak_rss_mb()
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)


# ---------------------------------------------------------------- databases


# A fresh database (a FILE_COPY of a template if given): its DSN, dropped afterwards.
database = temporary_database


def checkpoint(server: PostgresServer) -> None:
    """Flush dirty buffers now, so that a timed run does not pay for an earlier one's."""
    with (
        contextlib.suppress(psycopg.Error),
        psycopg.connect(server.admin_dsn, autocommit=True) as conn,
    ):
        conn.execute("CHECKPOINT")


def bytecode_env(home: Path) -> dict[str, str]:
    """Environment for Airflow processes that should load this checkout as a deployed wheel
    would: from bytecode. The provider is installed editable and CI sets
    PYTHONDONTWRITEBYTECODE, so without this every task process compiles the provider's
    modules from source (~15 ms of a no-op task on 3.3, measured; a cost no installed
    provider pays: pip compiles a wheel's modules when it installs it). The third-party
    packages are compiled by dev.py's install (``--compile-bytecode``)."""
    return {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(home / "pycache")}


# Airflow 3's task supervisor (supervisor.py ``_monitor_subprocess``, 3.3.2) can read the
# end of every socket of a task process just before the process has exited; it then waits
# in select() with nothing left to watch for up to ``[workers] min_heartbeat_interval``
# (default 5 s) before it notices the exit, holding the executor slot. Measured on the bench
# stack: 27-31 of 86 task processes of either DAG, fair or idempotent, at random. 1 s keeps
# that race from swamping the span figures (a task here takes ~0.2 s); the heartbeat itself
# is not reached by such short tasks.
SUPERVISOR_ENV = {"AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1"}


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
