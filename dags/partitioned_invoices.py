"""invoice_regions and regional_reconciliation: the invoice example on partitioned runs (3.2+).

``invoice_regions`` runs daily at 01:00 UTC on a ``CronPartitionTimetable``: each run
carries a partition key (``2026-10-01T01:00:00``) and no logical date; ``run_offset=-1``
makes the run fired at D+1 01:00 the partition of day D, as the cron DAG
``finalize_invoices`` keys it. Its task is mapped over the regions: each mapped instance
has its own run key (``eu|2026-10-01``, ``us|2026-10-01``), lock and record, and emits an
event of the ``regional_invoices`` asset for its region (``eu|2026-10-01T01:00:00``).

``regional_reconciliation`` runs per region and day on those events
(``PartitionedAssetTimetable`` with ``ProductMapper(IdentityMapper(), StartOfDayMapper())``:
partition key ``eu|2026-10-01``, the same run key). An event for a day already reconciled
(a producer run forced again) makes Airflow run the consumer again: a no-op.

To (re)process a day by hand, trigger ``invoice_regions`` with the partition key
``2026-10-01T01:00:00`` (the trigger form's Partition Key field), or backfill:
``airflow backfill create --dag-id invoice_regions --from-date 2026-10-01 --to-date 2026-10-07``
covers the partitions of 2026-10-01 .. 2026-10-06 (partition dates at 01:00, both ends
inclusive: 10-07 00:00 is before the 10-07 01:00 partition).
"""

from __future__ import annotations

import datetime as dt

import pendulum
from airflow import __version__ as airflow_version
from packaging.version import Version

from airflow_idempotency import IdempotentRunOperator, idempotency_params
from invoicing import tasks

JOBS_DB = "idempotency_default"
REGIONS = ["eu", "us"]


def partitioned_invoice_dags() -> None:
    """Define the two DAGs (partitioned runs exist from Airflow 3.2 on)."""
    from airflow.sdk import (
        DAG,
        Asset,
        CronPartitionTimetable,
        IdentityMapper,
        PartitionedAssetTimetable,
        ProductMapper,
        StartOfDayMapper,
    )

    # [START regional_invoices_asset]
    regional_invoices = Asset(name="regional_invoices", uri="invoicing://regional_invoices")
    # [END regional_invoices_asset]

    # [START invoice_regions]
    with DAG(
        dag_id="invoice_regions",
        schedule=CronPartitionTimetable("0 1 * * *", timezone="UTC", run_offset=-1),
        start_date=pendulum.datetime(2026, 10, 1, tz="UTC"),
        catchup=False,
        max_active_runs=4,
        default_args={"retries": 2, "retry_delay": dt.timedelta(seconds=5)},
        params=idempotency_params(),
        tags=["idempotency", "example", "partitions"],
        doc_md=__doc__,
    ):
        IdempotentRunOperator.partial(
            task_id="invoice_region",
            python_callable=tasks.create_region_invoices,
            postgres_conn_id=JOBS_DB,
            job_name="invoice_regions.invoice_region",
            reschedule_interval=dt.timedelta(seconds=15),
            outlets=[regional_invoices],
        ).expand(key_segment=REGIONS)
    # [END invoice_regions]

    # [START regional_reconciliation]
    with DAG(
        dag_id="regional_reconciliation",
        schedule=PartitionedAssetTimetable(
            assets=regional_invoices,
            default_partition_mapper=ProductMapper(IdentityMapper(), StartOfDayMapper()),
        ),
        start_date=pendulum.datetime(2026, 10, 1, tz="UTC"),
        catchup=False,
        params=idempotency_params(),
        tags=["idempotency", "example", "partitions"],
        doc_md=__doc__,
    ):
        IdempotentRunOperator(
            task_id="reconcile_region",
            python_callable=tasks.reconcile_region,
            postgres_conn_id=JOBS_DB,
            job_name="regional_reconciliation",
            reschedule_interval=dt.timedelta(seconds=15),
        )
    # [END regional_reconciliation]


# Airflow 2.11 and 3.0-3.1 have no partitioned runs: no DAG here.
if Version(Version(airflow_version).base_version) >= Version("3.2"):
    partitioned_invoice_dags()
