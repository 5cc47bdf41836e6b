"""Benchmark DAG (bench/partitions_e2e.py): the fair baseline of bench_idempotent_partitioned.

Daily partitions (CronPartitionTimetable, Airflow 3.2+); each of three chained plain tasks
opens one connection to the job database through PostgresHook and runs one query.
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.providers.postgres.hooks.postgres import PostgresHook
from airflow.sdk import DAG, CronPartitionTimetable, task


def one_query() -> None:
    conn = PostgresHook(postgres_conn_id="idempotency_default").get_conn()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1")
            cur.fetchone()
    finally:
        conn.close()


with DAG(
    dag_id="bench_fair_partitioned",
    schedule=CronPartitionTimetable("0 0 * * *", timezone="UTC"),
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=16,
    tags=["bench"],
):

    @task
    def step_1() -> None:
        one_query()

    @task
    def step_2() -> None:
        one_query()

    @task
    def step_3() -> None:
        one_query()

    step_1() >> step_2() >> step_3()
