"""Partitioned DAGs for tests/stack/test_partitions_stack.py (Airflow 3.2+).

Every task records its work in ``part_work`` (one row per execution of the work, not of
the task), so a test counts how often the work itself ran. A key listed in ``part_fail``
fails its work, for the reprocess-failed backfill.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pendulum
from airflow.sdk import (
    DAG,
    Asset,
    CronPartitionTimetable,
    PartitionedAssetTimetable,
    PartitionedAtRuntime,
    StartOfDayMapper,
)

from airflow_idempotency import IdempotentRunOperator, RunContext, RunKeyRule, idempotency_params

HOURLY = Asset(name="part_hourly_events", uri="test://part/hourly")
DAILY_DONE = Asset(name="part_daily_done", uri="test://part/daily")
OCTOBER: dict[str, Any] = {
    "start_date": pendulum.datetime(2026, 10, 1, tz="UTC"),
    "end_date": pendulum.datetime(2026, 10, 31, tz="UTC"),
}


def work(run: RunContext) -> dict[str, Any]:
    """Record one execution of the work; fail when the key is listed in part_fail."""
    with run.transaction() as cur:
        # Runs of several keys start at once (a caught-up schedule): CREATE TABLE IF NOT
        # EXISTS races on the catalog between transactions, so they take turns for it.
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended('part_work.ddl', 0))")
        cur.execute(
            "CREATE TABLE IF NOT EXISTS public.part_work (job text, run_key text,"
            " at timestamptz DEFAULT now())"
        )
        cur.execute("CREATE TABLE IF NOT EXISTS public.part_fail (run_key text PRIMARY KEY)")
        cur.execute("SELECT 1 FROM public.part_fail WHERE run_key = %s", (run.run_key,))
        if cur.fetchone():
            raise RuntimeError(f"part_fail lists {run.run_key}")
        cur.execute(
            "INSERT INTO public.part_work (job, run_key) VALUES (%s, %s)",
            (run.job_name, run.run_key),
        )
    return {"worked": 1}


def slow_work(run: RunContext) -> dict[str, Any]:
    """The work, taking 3 s: two overlapping runs meet on the lock."""
    import time

    time.sleep(3)
    return work(run)


# A locked key's try comes back after RESCHEDULE. Not shorter: Airflow's scheduler fails a
# try that rescheduled itself when the try's executor "success" is drained after the try was
# scheduled again (apache/airflow#71172, open; any executor: seen with LocalExecutor and 2 s
# in CI). docs/deploying.md says how to size it.
RESCHEDULE = dt.timedelta(seconds=10)


def task(**kwargs: Any) -> IdempotentRunOperator:
    return IdempotentRunOperator(
        task_id="work",
        python_callable=work,
        reschedule_interval=RESCHEDULE,
        **kwargs,
    )


# Scheduled by the scheduler: catch-up from three days ago (partitions of the days before).
with DAG(
    dag_id="part_scheduled",
    schedule=CronPartitionTimetable("0 1 * * *", timezone="UTC", run_offset=-1),
    start_date=pendulum.today("UTC").subtract(days=3),
    catchup=True,
    params=idempotency_params(),
    default_args={"retries": 0},
):
    task()

# Triggered, backfilled and cleared in October 2026 (its end_date keeps the scheduler off).
with DAG(
    dag_id="part_daily",
    schedule=CronPartitionTimetable("0 1 * * *", timezone="UTC", run_offset=-1),
    catchup=False,
    params=idempotency_params(),
    default_args={"retries": 0},
    **OCTOBER,
):
    task(outlets=[DAILY_DONE])

# An hourly producer and a daily consumer of its partitioned events.
with DAG(
    dag_id="part_hourly",
    schedule=CronPartitionTimetable("0 * * * *", timezone="UTC"),
    catchup=False,
    default_args={"retries": 0},
    **OCTOBER,
):
    task(outlets=[HOURLY], run_key_rule=RunKeyRule(period="hour"))

with DAG(
    dag_id="part_daily_consumer",
    schedule=PartitionedAssetTimetable(assets=HOURLY, default_partition_mapper=StartOfDayMapper()),
    start_date=pendulum.datetime(2026, 10, 1, tz="UTC"),
    catchup=False,
    default_args={"retries": 0},
):
    task()

# Keys typed at trigger time: segments, labels, and bad input (retries: refused input
# must fail without using them). Its run_key field takes segments (eu|2026-10-01).
with DAG(
    dag_id="part_runtime",
    schedule=PartitionedAtRuntime(),
    start_date=pendulum.datetime(2026, 10, 1, tz="UTC"),
    catchup=False,
    params=idempotency_params(segments=True),
    default_args={"retries": 2, "retry_delay": dt.timedelta(seconds=1)},
):
    task()

# A mapped task per region, slow enough for two overlapping runs to meet.
with DAG(
    dag_id="part_mapped",
    schedule=CronPartitionTimetable("0 1 * * *", timezone="UTC", run_offset=-1),
    catchup=False,
    max_active_runs=4,
    params=idempotency_params(),
    default_args={"retries": 0},
    **OCTOBER,
):
    IdempotentRunOperator.partial(
        task_id="work", python_callable=slow_work, reschedule_interval=RESCHEDULE
    ).expand(key_segment=["eu", "us", "apac"])

# A job that runs Tuesday to Saturday at 01:00, for the weekdays before (gaps --dag).
with DAG(
    dag_id="weekday_job",
    schedule="0 1 * * 2-6",
    catchup=False,
    default_args={"retries": 0},
    **OCTOBER,
):
    task()
