"""Benchmark DAG: three chained idempotent no-op tasks on daily partitions (3.2+).

For bench/partitions_e2e.py, on CronPartitionTimetable: the partition of day D has run key D.
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.sdk import DAG, CronPartitionTimetable, task

from airflow_idempotency import RunContext

with DAG(
    dag_id="bench_idempotent_partitioned",
    schedule=CronPartitionTimetable("0 0 * * *", timezone="UTC"),
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
