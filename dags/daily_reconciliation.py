"""daily_reconciliation, and the same schedule pasted twice.

The classic incident: a crontab line copied into a second place, so the job runs twice
at the same minute. Here both DAGs share one job name, so they share the lock and the
run record: whichever starts second waits, then finds the date completed (a no-op). The
tables are keyed by business date, so even a forced rerun writes ONE summary row per date.
"""

from __future__ import annotations

import datetime as dt

import pendulum
from airflow.providers.common.compat.sdk import DAG

from airflow_idempotency import IdempotentRunOperator, idempotency_params
from invoicing import tasks

# [START daily_reconciliation]
for dag_id in ("daily_reconciliation", "daily_reconciliation_pasted_twice"):
    with DAG(
        dag_id=dag_id,
        schedule="30 1 * * *",
        start_date=pendulum.datetime(2026, 10, 1, tz="UTC"),
        catchup=False,
        params=idempotency_params(),
        tags=["idempotency", "example"],
        doc_md=__doc__,
    ):
        IdempotentRunOperator(
            task_id="reconcile_stores",
            python_callable=tasks.reconcile_stores,
            postgres_conn_id="idempotency_default",
            job_name="daily_reconciliation",  # the same job in both DAGs: one lock, one record
            # Longer than the executor's report of a try takes to reach the scheduler: a
            # Celery "success" that arrives after the rescheduled try is already scheduled
            # again makes Airflow's scheduler fail the task (seen at 5 s).
            reschedule_interval=dt.timedelta(seconds=15),
        )
# [END daily_reconciliation]
