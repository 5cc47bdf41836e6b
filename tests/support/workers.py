"""Workers of the tests: ``airflow dags test`` in a private Airflow home (devtools.workers)
with a copy of the session's migrated metadata DB, on the test DAGs by default.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from devtools import workers
from devtools.workers import connection_env, dags_test, kill_group
from support import TESTS

__all__ = [
    "TEST_DAGS",
    "dags_test",
    "kill_group",
    "private_airflow_env",
    "start_worker",
    "wait_until",
]

TEST_DAGS = TESTS / "dags"


def private_airflow_env(
    airflow_home: Path, job_dsn: str, dags_folder: Path = TEST_DAGS, home: Path | None = None
) -> dict[str, str]:
    """os.environ plus an Airflow home of its own, with the job database ``job_dsn`` as
    connection ``idempotency_default`` (see :func:`devtools.workers.private_airflow_env`).

    The home is ``home`` (created; its owner removes it) or a new temporary folder.
    """
    if home is None:
        home = Path(tempfile.mkdtemp(prefix="idem-worker-")) / "home"
    return workers.private_airflow_env(
        airflow_home / "airflow.db", home, connection_env(job_dsn), dags_folder
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


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.1, what: str = "condition"):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it returns a truthy value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
