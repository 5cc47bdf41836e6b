"""finalize_invoices: invoice yesterday's shipped orders and export them, safely rerunnable.

Runs daily at 01:00 UTC and processes the day before: the run fired at D+1 01:00 has
business date D, the run key. Airflow 3 builds a CronTriggerTimetable for a cron schedule
(logical date D+1 01:00: the default RunKeyRule takes offset -1), Airflow 2 a
CronDataIntervalTimetable (logical date D 01:00, the interval's start: offset 0). Both map
the same run to the same key.

To rerun a date by hand, trigger with ``{"run_key": "2026-10-01"}`` (the trigger form's
"Run key" field). ``force`` recomputes the internal writes but never resends a confirmed
export; ``force_reconcile`` compares ledger, invoices and the accounting service.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pendulum
from airflow.providers.common.compat.sdk import DAG, AirflowSkipException, Context, Param, task

from airflow_idempotency import (
    IdempotentRunOperator,
    RunContext,
    RunOptions,
    idempotency_params,
)
from airflow_idempotency.operator import conf_flag
from invoicing import tasks

JOBS_DB = "idempotency_default"  # job_runs, the ledger and the example tables share one DB


# [START reconcile_export_operator]
class ReconcileExportOperator(IdempotentRunOperator):
    """Runs only when the run's conf sets force_reconcile, and then always (force)."""

    def execute(self, context: Context) -> dict[str, Any]:
        if not conf_flag(context, "force_reconcile"):
            raise AirflowSkipException("force_reconcile is not set: nothing to reconcile")
        return super().execute(context)

    def run_options(self, context: Context) -> RunOptions:
        return RunOptions(force=True, dry_run=conf_flag(context, "dry_run"))

    def run(self, ctx: RunContext) -> dict[str, Any]:
        base_url, options = tasks.accounting_endpoint()
        return tasks.reconcile_export(
            ctx, base_url, export_job_name="finalize_invoices.export_invoices", **options
        )
        # [END reconcile_export_operator]


# [START finalize_invoices]
with DAG(
    dag_id="finalize_invoices",
    schedule="0 1 * * *",
    start_date=pendulum.datetime(2026, 10, 1, tz="UTC"),
    catchup=False,
    max_active_runs=4,
    default_args={"retries": 2, "retry_delay": dt.timedelta(seconds=5)},
    params={
        **idempotency_params(),
        "force_reconcile": Param(False, type="boolean", title="Reconcile the export"),
    },
    tags=["idempotency", "example"],
    doc_md=__doc__,
):

    @task.idempotent_run(postgres_conn_id=JOBS_DB, job_name="finalize_invoices.create_invoices")
    def create_invoices(run: RunContext) -> dict[str, int]:
        return tasks.create_invoices(run)

    @task.idempotent_run(postgres_conn_id=JOBS_DB, job_name="finalize_invoices.rebuild_totals")
    def rebuild_totals(run: RunContext) -> dict[str, int]:
        return tasks.rebuild_daily_totals(run)

    @task.idempotent_run(postgres_conn_id=JOBS_DB, job_name="finalize_invoices.export_invoices")
    def export_invoices(run: RunContext) -> dict[str, int]:
        base_url, options = tasks.accounting_endpoint()
        return tasks.export_invoices(run, base_url, **options)

    reconcile = ReconcileExportOperator(
        task_id="reconcile_export",
        postgres_conn_id=JOBS_DB,
        job_name="finalize_invoices.reconcile_export",
    )

    create_invoices() >> rebuild_totals() >> export_invoices() >> reconcile
# [END finalize_invoices]
