"""idempotency_watch: fail, so that Airflow's own alerting fires, when a watched job has a
business date without a completed run in the last days, or work nobody is doing.

Runs daily at 06:00 UTC: by then every watched daily job should have completed yesterday.
A date is a gap when it has no completed run (never run, failed, or still started); a key is
stale when its attempt still says running, or it says started, and nobody holds its lock (a
worker died and nothing retried it). The task log names each, and the failure's message
sums them up (an email or a Slack callback shows it as it is).

Params: ``jobs`` (job names), ``days`` (how many days back from yesterday, default 7).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import pendulum
from airflow.providers.common.compat.sdk import DAG, AirflowException, Param, task

from airflow_idempotency import IdempotencyHook
from airflow_idempotency.schema import DEFAULT_SCHEMA

log = logging.getLogger(__name__)

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
        "jobs": Param(WATCHED, type="array", title="Jobs to watch"),
        "days": Param(7, type="integer", minimum=1, title="Days back from yesterday"),
    },
    tags=["idempotency", "example", "monitoring"],
    doc_md=__doc__,
):

    @task
    def watch(params: dict[str, Any] | None = None) -> dict[str, int]:
        from airflow_idempotency import status

        assert params is not None
        last = dt.datetime.now(dt.timezone.utc).date() - dt.timedelta(days=1)
        first = last - dt.timedelta(days=int(params["days"]) - 1)
        with IdempotencyHook().new_connection() as conn:
            conn.autocommit = True
            problems = status.problems(
                conn, DEFAULT_SCHEMA, list(params["jobs"]), first.isoformat(), last.isoformat()
            )
        for problem in problems:
            log.error("idempotency_watch: %s", problem)
        if problems:
            raise AirflowException(
                f"{len(problems)} problem(s) in {first} .. {last}: " + "; ".join(problems[:20])
            )
        return {"jobs": len(params["jobs"]), "days": int(params["days"])}

    watch()
