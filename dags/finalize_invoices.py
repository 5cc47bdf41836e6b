"""finalize_invoices: invoice yesterday's shipped orders and export them, safely rerunnable.

Runs daily at 01:00 UTC and processes the day before: the run fired at D+1 01:00 has
business date D, the run key. Airflow 3 builds a CronTriggerTimetable for a cron schedule
(logical date D+1 01:00: the default RunKeyRule takes offset -1), Airflow 2 a
CronDataIntervalTimetable (logical date D 01:00, the interval's start: offset 0). Both map
the same run to the same key.

To rerun a date by hand, trigger with ``{"run_key": "2026-10-01"}`` (the trigger form's
"Run key" field). ``force`` recomputes the internal writes but never resends a confirmed
export; ``force_reconcile`` compares ledger, invoices and the accounting service.

The date's export file (``invoices/<date>.csv`` below the ``invoice_exports`` connection's
path) and the finance summary email (through the ``finance_smtp`` connection) go through the
same contract: a rerun leaves the file alone and sends no second email. Each task is skipped,
saying so, when its connection is not defined.
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

    def execute(self, context: Context) -> dict[str, Any] | None:
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


class ConfiguredOperator(IdempotentRunOperator):
    """Runs only when the Airflow connection ``needs`` is defined; skipped, saying so, if not."""

    def __init__(self, *, needs: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.needs = needs

    def execute(self, context: Context) -> dict[str, Any] | None:
        from airflow.providers.common.compat.sdk import BaseHook

        try:
            BaseHook.get_connection(self.needs)
        except Exception as exc:
            if type(exc).__name__ != "AirflowNotFoundException":
                raise
            message = f"no Airflow connection {self.needs!r}: not configured, nothing done"
            raise AirflowSkipException(message) from None
        return super().execute(context)


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

    export_file = ConfiguredOperator(
        task_id="write_export_file",
        needs=tasks.EXPORTS_CONN,
        postgres_conn_id=JOBS_DB,
        job_name="finalize_invoices.write_export_file",
        python_callable=tasks.write_export_file,
    )
    summary_mail = ConfiguredOperator(
        task_id="email_finance_summary",
        needs=tasks.FINANCE_MAIL_CONN,
        postgres_conn_id=JOBS_DB,
        job_name="finalize_invoices.email_finance_summary",
        python_callable=tasks.email_finance_summary,
        trigger_rule="none_failed",  # also when the export file is not configured (skipped)
    )

    exported = export_invoices()
    create_invoices() >> rebuild_totals() >> exported >> [reconcile, export_file]
    export_file >> summary_mail
# [END finalize_invoices]
