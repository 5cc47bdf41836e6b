"""Benchmark and test DAG (bench/scale_airflow.py): N idempotent tasks of one run at once.

One mapped ``IdempotentRunOperator`` over ``SCALE_AIRFLOW_TASKS`` segments (default 40): each
mapped task is its own run key (``s07|2026-10-01``), holds it in the lock mode its Airflow
connection's extra names, sleeps ``SCALE_AIRFLOW_WORK_SECONDS`` outside any transaction, then
writes one row of ``public.scale_work`` (its key, when its work began and ended) through
``run.transaction()``. Two DAGs, one per lock mode, each on its own Airflow connection (and
so its own job database): ``scale_airflow_lease`` and ``scale_airflow_advisory``.
"""

from __future__ import annotations

import datetime as dt
import os
import time

from airflow.sdk import DAG

from airflow_idempotency import IdempotentRunOperator, RunContext

TASKS = int(os.environ.get("SCALE_AIRFLOW_TASKS", "40"))
WORK_SECONDS = float(os.environ.get("SCALE_AIRFLOW_WORK_SECONDS", "5"))


def work(run: RunContext) -> dict[str, int]:
    """Sleep, then write this key's row once, in the run's fenced transaction."""
    began = dt.datetime.now(dt.timezone.utc)
    time.sleep(WORK_SECONDS)
    with run.transaction() as cur:
        cur.execute(
            "INSERT INTO public.scale_work (run_key, began, ended)"
            " VALUES (%s, %s, clock_timestamp())",
            (run.run_key, began),
        )
    return {"rows": 1}


for mode in ("lease", "advisory"):
    with DAG(
        dag_id=f"scale_airflow_{mode}",
        schedule=None,
        start_date=dt.datetime(2026, 10, 1, tzinfo=dt.timezone.utc),
        catchup=False,
        max_active_runs=1,
        max_active_tasks=TASKS,
        default_args={"retries": 0},
        tags=["bench"],
    ):
        IdempotentRunOperator.partial(
            task_id="work",
            python_callable=work,
            postgres_conn_id=f"scale_{mode}",
            on_locked="fail",
        ).expand(key_segment=[f"s{i:02d}" for i in range(TASKS)])
