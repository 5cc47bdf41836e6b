"""Benchmark DAG (bench/airflow_e2e.py): three chained plain no-op tasks.

The baseline of bench_idempotent_noop: same schedule, same shape, plain @task.
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.providers.common.compat.sdk import DAG, task

with DAG(
    dag_id="bench_plain_noop",
    schedule="@daily",
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=16,
    tags=["bench"],
):

    @task
    def step_1() -> None:
        return None

    @task
    def step_2() -> None:
        return None

    @task
    def step_3() -> None:
        return None

    step_1() >> step_2() >> step_3()
