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

from devtools import airflow_env

TEST_DAGS = Path(__file__).parent / "dags"


def private_airflow_env(
    airflow_home: Path, job_dsn: str, dags_folder: Path = TEST_DAGS
) -> dict[str, str]:
    """os.environ plus an Airflow home of its own (a copy of the migrated metadata DB)."""
    home = Path(tempfile.mkdtemp(prefix="idem-worker-"))
    shutil.copy(airflow_home / "airflow.db", home / "airflow.db")
    env = dict(os.environ)
    airflow_env.configure(home, env)
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(dags_folder)
    env["AIRFLOW_CONN_IDEMPOTENCY_DEFAULT"] = airflow_env.airflow_connection_json(job_dsn)
    return env


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
    cmd = [sys.executable, "-m", "airflow", "dags", "test", dag_id, date]
    if conf:
        cmd += ["-c", conf]
    return subprocess.Popen(
        cmd,
        env=worker_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the worker and everything it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
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
