"""Workers of the tests: ``airflow dags test`` in a private Airflow home; :func:`race`.

``airflow dags test`` (devtools.workers) with a copy of the session's migrated metadata DB, on
the test DAGs by default; and :func:`race`, two workers on one run key.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psycopg

from devtools import workers
from devtools.airflow_env import connection_env
from devtools.workers import dags_test, kill_group
from support import TESTS

__all__ = [
    "TEST_DAGS",
    "Finished",
    "Until",
    "dags_test",
    "kill_group",
    "migrated_db",
    "private_airflow_env",
    "race",
    "start_worker",
    "wait_until",
    "work_log_count",
]

TEST_DAGS = TESTS / "dags"


def migrated_db(airflow_home: Path) -> Path:
    """The session's metadata DB as it was once migrated, before any test ran a DAG in it: a
    worker's home starts from a copy, so that what it finds does not depend on the tests that
    ran before it (a backfill would find their runs of its dates done)."""
    return airflow_home / "migrated.db"


def private_airflow_env(
    airflow_home: Path, job_dsn: str, dags_folder: Path = TEST_DAGS, home: Path | None = None
) -> dict[str, str]:
    """os.environ plus an Airflow home of its own (its metadata DB a copy of
    :func:`migrated_db`), with the job database ``job_dsn`` as connection
    ``idempotency_default`` (see :func:`devtools.workers.private_airflow_env`).

    The home is ``home`` (created; its owner removes it) or a new temporary folder.
    """
    if home is None:
        home = Path(tempfile.mkdtemp(prefix="idem-worker-")) / "home"
    return workers.private_airflow_env(
        migrated_db(airflow_home), home, connection_env(job_dsn), dags_folder
    )


def start_worker(
    airflow_home: Path,
    dag_id: str,
    date: str,
    job_dsn: str,
    env: dict[str, str] | None = None,
    conf: str | None = None,
    dags_folder: Path = TEST_DAGS,
) -> subprocess.Popen[str]:
    """Start ``airflow dags test DAG_ID DATE`` in its own process group and Airflow home."""
    worker_env = private_airflow_env(airflow_home, job_dsn, dags_folder)
    worker_env.update(env or {})
    return dags_test(worker_env, dag_id, date, conf)


T = TypeVar("T")


def work_log_count(dsn: str) -> int:
    """Rows in ``public.work_log``, where the test DAGs' ``core_slow_job`` records each
    execution's start (0 before the first: the table is made with it, in its transaction)."""
    with psycopg.connect(dsn) as conn:
        found = conn.execute("SELECT to_regclass('public.work_log') IS NOT NULL").fetchone()
        if not (found and found[0]):
            return 0
        counted = conn.execute("SELECT count(*) FROM public.work_log").fetchone()
        return int(counted[0]) if counted else 0


def wait_until(
    predicate: Callable[[], T | None],
    timeout: float = 60.0,
    interval: float = 0.1,
    what: str = "condition",
) -> T:
    """Poll ``predicate`` until it returns a truthy value; return it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass(frozen=True)
class Until:
    """A moment to wait for: a condition polled until it is truthy, and what it means (the
    timeout's error names it)."""

    condition: Callable[[], object]
    what: str


@dataclass(frozen=True)
class Finished:
    """A worker that has exited: its pid, exit code and output."""

    pid: int
    returncode: int
    output: str


def race(
    start_first: Callable[[], subprocess.Popen[str]],
    start_second: Callable[[], subprocess.Popen[str]],
    release: Path,
    *,
    first_holds: Until,
    second_refused: Until | None,
    wait: float,
    finish: float = 240,
) -> tuple[Finished, Finished]:
    """Two workers on one run key, the second while the first holds it: start the first (its
    work waits for the file ``release``), wait until ``first_holds``, start the second, wait
    until ``second_refused`` (None: until the second has exited), release the first, and
    collect both (each within ``finish`` seconds). Whatever happens, ``release`` is created
    and both process groups are killed."""
    first = start_first()
    second: subprocess.Popen[str] | None = None
    try:
        wait_until(first_holds.condition, timeout=wait, what=first_holds.what)
        second = start_second()
        if second_refused is None:
            second_output, _ = second.communicate(timeout=finish)
        else:
            wait_until(second_refused.condition, timeout=wait, what=second_refused.what)
        release.touch()
        first_output, _ = first.communicate(timeout=finish)
        if second_refused is not None:
            second_output, _ = second.communicate(timeout=finish)
    finally:
        release.touch()
        kill_group(first)
        if second is not None:
            kill_group(second)
    return (
        Finished(first.pid, first.returncode, first_output),
        Finished(second.pid, second.returncode, second_output),
    )
