"""Start ``airflow dags test`` in separate OS processes, each with its own metadata DB.

Two ``dags test`` runs of one date against one metadata DB delete each other's runs, so
each worker gets a copy of the migrated SQLite file: they share only the job database,
which is exactly where the idempotency contract must hold.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from airflow_idempotency.crashpoints import CRASH_ENV, SLEEP_ENV, WAIT_ENV
from devtools import airflow_env

TEST_DAGS = Path(__file__).parent / "dags"


def private_airflow_env(
    airflow_home: Path, job_dsn: str, dags_folder: Path = TEST_DAGS, home: Path | None = None
) -> dict[str, str]:
    """os.environ plus an Airflow home of its own (a copy of the migrated metadata DB).

    The home is ``home`` (created; its owner removes it) or a new temporary folder. Fault
    points of this process are not inherited: a worker gets them only through ``env``.
    """
    if home is None:
        home = Path(tempfile.mkdtemp(prefix="idem-worker-"))
    else:
        home.mkdir(parents=True, exist_ok=False)
    shutil.copy(airflow_home / "airflow.db", home / "airflow.db")
    env = dict(os.environ)
    for name in (CRASH_ENV, SLEEP_ENV, WAIT_ENV):
        env.pop(name, None)
    airflow_env.configure(home, env)
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(dags_folder)
    env["AIRFLOW_CONN_IDEMPOTENCY_DEFAULT"] = airflow_env.airflow_connection_json(job_dsn)
    return env


def dags_test(
    env: dict[str, str], dag_id: str, date: str, conf: str | None = None
) -> subprocess.Popen[str]:
    """Start ``airflow dags test DAG_ID DATE`` with ``env``, in its own process group."""
    cmd = [sys.executable, "-m", "airflow", "dags", "test", dag_id, date]
    if conf:
        cmd += ["-c", conf]
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
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


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the worker's process group (only ours: its id is the worker's pid)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.1, what: str = "condition"):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it returns a truthy value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
