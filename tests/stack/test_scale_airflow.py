"""Issue 32 in real Airflow: 40 idempotent tasks at once (a LocalExecutor of parallelism 40)
through a PgBouncer pool of 10 in transaction mode, the lease mode chosen in the Airflow
connection's extra. The scenario is the scale benchmark's own (bench/scale_airflow.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.scale_airflow import AirflowScenario, airflow_scale_stack, run_airflow_cell
from devtools import pgbouncer
from devtools.postgres import PostgresServer

TASKS = 40
POOL = 10


def test_40_airflow_tasks_through_a_pool_of_10_in_lease_mode(
    pg_server: PostgresServer, tmp_path: Path
) -> None:
    """40 mapped idempotent tasks of one DAG run, all running at once: all succeed, each
    key's work committed once, one completed attempt per key, never more than 10 server
    connections to the job database, and more tasks inside their work at once than the
    pool has connections (the pool was really oversubscribed)."""
    if not pgbouncer.installed():
        if os.environ.get("CI"):
            pytest.fail("pgbouncer is not installed (.ci/run installs it)")
        pytest.skip("pgbouncer is not installed: apt-get install pgbouncer")
    scenario = AirflowScenario(TASKS, "lease", POOL, work_seconds=20.0, query_wait_timeout=15)
    with airflow_scale_stack(pg_server, [scenario], tmp_path / "home") as (stack, bouncer, jobs):
        cell = run_airflow_cell(pg_server, stack, bouncer, jobs["lease"], scenario)
    print(f"\n{cell.summary()}")
    assert cell.run_state == "success", cell.summary()
    assert cell.task_states == {"success": TASKS}, cell.summary()
    assert cell.all_completed_once, cell.summary()
    assert set(cell.attempts) == {"completed"}, cell.summary()
    assert cell.peak_server_connections <= POOL, cell.summary()
    assert cell.peak_working > POOL, cell.summary()
