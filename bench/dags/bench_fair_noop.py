"""Benchmark DAG (bench/airflow_e2e.py): the fair baseline of bench_idempotent_noop.

Same schedule and shape; each plain task opens one connection to the job database through
PostgresHook and runs one query: what a plain task that touches that database pays (the
hook's imports, the connection lookup, connect, one round trip). An idempotent no-op needs
the lookup and its connections, not the hook's imports (airflow_idempotency.connection).
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.providers.common.compat.sdk import DAG, task
from airflow.providers.postgres.hooks.postgres import PostgresHook


def one_query() -> None:
    conn = PostgresHook(postgres_conn_id="idempotency_default").get_conn()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1")
            cur.fetchone()
    finally:
        conn.close()


with DAG(
    dag_id="bench_fair_noop",
    schedule="@daily",
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
