"""idempotency_watch: fails when a watched job has a gap or stale work, so Airflow alerts.

It fails, so that Airflow's own alerting fires, when a watched job has a business date without
a completed run in the last days, or work nobody is doing.

Runs daily at 06:00 UTC: by then every watched daily job should have completed yesterday.
The window is the ``days`` days before this run's own date (its logical date, or when it
was started): a backfilled watch run for 2026-10-08 checks 2026-10-01 .. 10-07, not the
week before today. The watched jobs are the idempotent tasks of the DAGs in ``dags``, and
their keys follow each DAG's schedule: a key is expected only when the DAG's schedule had
started its run by then (a weekday-only job's weekends are no gaps, and neither is a day
whose run is not due yet), segments included (``eu|2026-10-01``).

A key is a gap when it has no completed run (never run, failed, or still started); a key is
stale when its attempt still says running, or it says started, and nobody holds its lock (a
worker died and nothing retried it). The task log names each, and the failure's message
sums them up (an email or a Slack callback shows it as it is).

Params: ``dags`` (the DAGs whose schedules say which keys are due), ``jobs`` (the job
names to watch), ``days`` (how many days back from the day before this run's date,
default 7).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import pendulum
from airflow.providers.common.compat.sdk import DAG, AirflowException, Param, task

log = logging.getLogger(__name__)

WATCHED_DAGS = ["finalize_invoices", "daily_reconciliation"]
WATCHED = [
    "finalize_invoices.create_invoices",
    "finalize_invoices.rebuild_totals",
    "finalize_invoices.export_invoices",
    "daily_reconciliation",
]

with DAG(
    dag_id="idempotency_watch",
    schedule="0 6 * * *",
    start_date=pendulum.datetime(2026, 10, 1, tz="UTC"),
    catchup=False,
    default_args={"retries": 0},
    params={
        "dags": Param(WATCHED_DAGS, type="array", title="DAGs whose schedules to follow"),
        "jobs": Param(WATCHED, type="array", title="Jobs to watch"),
        "days": Param(7, type="integer", minimum=1, title="Days back from yesterday"),
    },
    tags=["idempotency", "example", "monitoring"],
    doc_md=__doc__,
):
    # [START watch_window]
    # [START watch_task]
    @task
    def watch(params: dict[str, Any] | None = None, **context: Any) -> dict[str, int]:
        from airflow_idempotency.watch import watch_problems  # in the task: parsing stays light

        assert params is not None
        as_of = context.get("logical_date") or context["dag_run"].run_after
        last = as_of.date() - dt.timedelta(days=1)
        first = last - dt.timedelta(days=int(params["days"]) - 1)
        problems = watch_problems(params["dags"], params["jobs"], first, last, as_of=as_of)
        # [END watch_window]
        for problem in problems:
            log.error("idempotency_watch: %s", problem)
        if problems:
            raise AirflowException(
                f"{len(problems)} problem(s) in {first} .. {last}: " + "; ".join(problems[:20])
            )
        return {"jobs": len(params["jobs"]), "days": int(params["days"])}

    # [END watch_task]
    watch()
