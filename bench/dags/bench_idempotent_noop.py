"""Benchmark DAG (bench/airflow_e2e.py): three chained idempotent no-op tasks.

Same shape as bench_plain_noop. Once a date's keys are completed, a rerun of the date is
three no-op decisions (lock, read, noop attempt row, unlock) and nothing else.
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.providers.common.compat.sdk import DAG, task

from airflow_idempotency import RunContext

with DAG(
    dag_id="bench_idempotent_noop",
    schedule="@daily",
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=16,
    tags=["bench"],
):

    @task.idempotent_run(postgres_conn_id="idempotency_default", on_locked="fail")
    def step_1(run: RunContext) -> None:
        return None

    @task.idempotent_run(postgres_conn_id="idempotency_default", on_locked="fail")
    def step_2(run: RunContext) -> None:
        return None

    @task.idempotent_run(postgres_conn_id="idempotency_default", on_locked="fail")
    def step_3(run: RunContext) -> None:
        return None

    # mypy reads Airflow's TaskFlow typing: it does not know the operator passes the RunContext.
    step_1() >> step_2() >> step_3()  # type: ignore[call-arg, misc]
