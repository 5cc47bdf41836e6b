"""Helpers shared by the fault scenarios (tests/faults/test_faults_*.py).

Workers are ``airflow dags test`` processes started by devtools/workers.py, with their Airflow
home under a folder the caller owns, so every home is removed with it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from devtools import invariants
from devtools.airflow_env import AIRFLOW_2, DAGS_FOLDER, connection_env
from devtools.invariants import fire_time
from devtools.workers import dags_test, kill_group
from support.db import rows as db_rows
from support.workers import private_airflow_env

__all__ = ["connection_env", "kill_group"]  # the scenarios import them from here too

D = "2026-10-01"  # the business date of every finalize_invoices scenario
# The scheduled run that processes it (0 1 * * *): fired at D+1 01:00, its logical date on
# Airflow 3; Airflow 2 names it by the start of its interval, D 01:00.
FIRE = fire_time(D, interval_start=AIRFLOW_2)
JOBS = ("create_invoices", "rebuild_totals", "export_invoices")

LEASE_TTL = 5.0
"""The lease mode's time to live in the scenarios (docs/locks.md): a crashed worker's key is
free again within it, so a rerun started after it does not wait (the default is 30 s)."""


def lock_extra(lock_mode: str, lease_ttl: float = LEASE_TTL) -> dict[str, Any]:
    """The job connection's extra that makes its runs use ``lock_mode`` (connection_env's
    ``job_extra``): none for the advisory mode, the default."""
    if lock_mode == "advisory":
        return {}
    return {"lock_mode": lock_mode, "lease_ttl": lease_ttl}


def lock_modes_used(dsn: str) -> set[str]:
    """The lock mode of every attempt that held its key (not a no-op nor a refusal): an
    attempt of the lease mode records no lock session (``lock_backend_pid`` NULL)."""
    found = db_rows(
        dsn,
        "SELECT DISTINCT lock_backend_pid IS NULL FROM idempotency.job_run_attempts"
        " WHERE outcome NOT IN ('noop', 'lock_held')",
    )
    return {"lease" if leased else "advisory" for (leased,) in found}


def wait_for_expired_leases(dsn: str, timeout: float = LEASE_TTL + 10) -> float:
    """Wait until no lease of the database is live (a dead worker's expired: its key is free
    to take over); return the seconds waited. Within ``timeout``, or an AssertionError."""
    began = time.monotonic()
    live = "SELECT count(*) FROM idempotency.run_leases WHERE expires_at > clock_timestamp()"
    while db_rows(dsn, live) != [(0,)]:
        assert time.monotonic() - began < timeout, f"a lease still live after {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - began


def lease_rows(dsn: str) -> int:
    """Rows of ``run_leases`` now (taken and not released: live, or left by a dead worker)."""
    return int(db_rows(dsn, "SELECT count(*) FROM idempotency.run_leases")[0][0])


def spawn_worker(
    airflow_home: Path,
    home: Path,
    job_dsn: str,
    env: dict[str, str],
    dag_id: str = "finalize_invoices",
    date: str = FIRE,
    conf: str | None = None,
) -> subprocess.Popen[str]:
    """Start ``airflow dags test DAG_ID DATE`` in its own process group, Airflow home ``home``."""
    worker_env = private_airflow_env(airflow_home, job_dsn, DAGS_FOLDER, home=home)
    worker_env.update(env)
    return dags_test(worker_env, dag_id, date, conf)


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str, float]:
    """Wait for a worker; return its exit code, its output and how long it ran from now."""
    started = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)  # nothing it started may outlive it (a crash leaves no children)
    return proc.returncode, out, time.monotonic() - started


def job_statuses(dsn: str, run_key: str = D) -> dict[str, str]:
    """task -> job_runs.status of the finalize_invoices jobs (absent: never started)."""
    return invariants.job_statuses(dsn, run_key)


def final_state(dsn: str, day: str = D) -> dict[str, Any]:
    """What must be identical to an uninterrupted run, in a form comparable across
    databases (devtools.invariants.portable_date_state): invoices by their natural
    columns, totals, the ledger as (key, status), the remote invoices as (key, order_id),
    the jobs' statuses. Remote references differ between databases, so they are checked
    for consistency inside one database instead (see :func:`check_consistency`)."""
    return invariants.portable_date_state(dsn, day)


def check_consistency(dsn: str, day: str = D) -> dict[str, Any]:
    """Duplicates and ledger/remote disagreements in one database: all must be empty."""
    keys = {"keys": [day]}
    return {
        "duplicate_remote_orders": invariants.rows(dsn, "remote_duplicate_orders"),
        "duplicate_invoices": invariants.rows(dsn, "duplicate_invoices"),
        # A ledger row of the (exported) date not confirmed, or whose reference is not
        # the remote's invoice for that key.
        "reference_mismatch": invariants.rows(dsn, "ledger_not_confirmed_by_remote", keys),
        # A remote invoice for another order than the key names.
        "key_order_mismatch": invariants.rows(dsn, "remote_key_order_mismatch"),
    }


NO_PROBLEMS: dict[str, list[tuple[Any, ...]]] = {
    "duplicate_remote_orders": [],
    "duplicate_invoices": [],
    "reference_mismatch": [],
    "key_order_mismatch": [],
}


@contextlib.contextmanager
def invoicing_world(
    pg_server: Any, orders: int, seed: int = 7, day: str = D
) -> Iterator[tuple[str, Any]]:
    """A fresh job database seeded with ``orders`` orders and its own accounting service."""
    from devtools.accounting import run_accounting_service
    from invoicing.seed import seed_orders

    name = pg_server.create_database("idem_fault")
    dsn = pg_server.dsn(name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            date = dt.date.fromisoformat(day)
            seed_orders(conn, date, date, orders, seed)
        with run_accounting_service(dsn) as service:
            yield dsn, service
    finally:
        pg_server.drop_database(name)


def service_counts(service: Any) -> dict[str, int]:
    """Requests, replays and invoices of the service, read after its counters were flushed."""
    time.sleep(0.3)  # the service flushes its request counters every 0.1 s
    stats = service.stats()
    return {k: stats[k] for k in ("requests", "replays", "invoices")}


class Watched:
    """A worker whose output is read as it comes, so a test can wait for a line of it."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 180) -> None:
        """Wait until ``text`` appears in the output (fail early if the worker exits)."""
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"worker exited before {text!r}:\n{self.output[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} after {timeout}s:\n{self.output[-4000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout)
            self._reader.join(timeout=30)
        finally:
            kill_group(self.proc)
        return self.proc.returncode, self.output


def figures(text: str) -> None:
    """Print what a scenario measured; devtools/fault_report.py copies these lines to FAULTS.md."""
    print(f"[figures] {text}", flush=True)


def refusal(error: BaseException, seconds: float | None = None) -> str:
    """How a refusal reads in FAULTS.md: the error's type and the start of its message (what
    the user sees), and how long it took when ``seconds`` is given."""
    message = " ".join(str(error).split())
    message = message if len(message) <= 160 else message[:157] + "..."
    took = "" if seconds is None else f" after {seconds * 1000:.0f} ms"
    return f"refused{took} with {type(error).__name__}: {message}"
