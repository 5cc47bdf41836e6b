"""A team mid-upgrade: an Airflow 2.11 worker and an Airflow 3 worker on one job database.

Both lines run the same provider code against the same bookkeeping schema; the run lock
and the records must not care which Airflow started a task. Needs the Airflow 2.11
environment (`python3 dev.py setup --airflow 2`, done by `.ci/run`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from airflow_idempotency.schema import latest_version
from devtools import airflow_env
from devtools.airflow_env import connection_env
from devtools.workers import dags_test, private_airflow_env
from support.db import rows
from support.locks import lock_held_attempts
from support.workers import TEST_DAGS, Until, migrated_db, race, work_log_count

AIRFLOW2_PYTHON = os.environ.get("IDEMPOTENCY_AIRFLOW2_PYTHON", "")


@pytest.fixture(scope="module")
def airflow2_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated Airflow 2.11 metadata DB, copied into each 2.11 worker's home."""
    if not os.access(AIRFLOW2_PYTHON, os.X_OK):
        if os.environ.get("CI"):
            pytest.fail(f"the Airflow 2.11 environment is missing ({AIRFLOW2_PYTHON!r})")
        pytest.skip("no Airflow 2.11 environment: run `python3 dev.py setup --airflow 2`")
    home = tmp_path_factory.mktemp("airflow2-template")
    env = dict(os.environ)
    airflow_env.configure(home, env, airflow2=True)
    airflow_env.migrate(env, python=AIRFLOW2_PYTHON)
    return home / "airflow.db"


def worker(
    python: str, template: Path, home: Path, dsn: str, airflow2: bool, **extra: str
) -> subprocess.Popen[str]:
    """`airflow dags test core_slow_job 2026-10-02` of one line, in a private home."""
    env = private_airflow_env(template, home, connection_env(dsn), TEST_DAGS, airflow2=airflow2)
    env.update(extra)
    return dags_test(env, "core_slow_job", "2026-10-02", python=python)


def test_airflow2_and_airflow3_workers_share_one_key(
    airflow_home: Path, airflow2_db: Path, pg_dsn: str, tmp_path: Path
) -> None:
    """A 2.11 worker and a 3.x worker on the same business date of the same job: the work
    runs once, the other waits and no-ops, the records agree, the schema is migrated once."""
    import sys

    release = tmp_path / "release"
    hold = {"IDEM_TEST_HOLD_FILE": str(release)}
    old, new = race(
        lambda: worker(AIRFLOW2_PYTHON, airflow2_db, tmp_path / "a2", pg_dsn, True, **hold),
        lambda: worker(
            sys.executable, migrated_db(airflow_home), tmp_path / "a3", pg_dsn, False, **hold
        ),
        release,
        first_holds=Until(
            lambda: work_log_count(pg_dsn), "the Airflow 2.11 worker to start working"
        ),
        second_refused=Until(
            lambda: lock_held_attempts(pg_dsn), "the Airflow 3 worker to find the key locked"
        ),
        wait=120,
    )
    assert old.returncode == 0, old.output[-3000:]
    assert new.returncode == 0, new.output[-3000:]
    assert rows(pg_dsn, "SELECT count(*) FROM public.work_log") == [(1,)]
    by_pid = rows(
        pg_dsn,
        "SELECT pid, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id",
    )
    assert by_pid[0] == (old.pid, "completed"), by_pid
    assert {o for p, o in by_pid[1:]} <= {"lock_held", "noop"} and by_pid[-1] == (new.pid, "noop")
    assert {p for p, _ in by_pid[1:]} == {new.pid}
    assert rows(pg_dsn, "SELECT status, attempt_count FROM idempotency.job_runs") == [
        ("completed", 1)
    ]
    assert rows(pg_dsn, "SELECT version FROM idempotency.schema_version ORDER BY 1") == [
        (v,) for v in range(1, latest_version() + 1)
    ]
