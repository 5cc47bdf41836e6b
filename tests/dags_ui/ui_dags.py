"""Two small DAGs of idempotent tasks for the Run keys view's end-to-end tests."""

from __future__ import annotations

import pendulum
from airflow.providers.common.compat.sdk import DAG

from airflow_idempotency import IdempotentRunOperator, RunContext, idempotency_params

FAILING_KEY = "2026-10-02"


def count_rows(run: RunContext) -> dict[str, int]:
    """Three rows; the load of FAILING_KEY fails (so the view has a failed key to show)."""
    if run.run_key == FAILING_KEY and run.job_name.endswith(".load"):
        raise RuntimeError("the warehouse refused the load of 2026-10-02 (a test failure)")
    return {"rows": 3}


for dag_id, task_ids in (("ui_demo", ("extract", "load")), ("ui_secret", ("pay",))):
    # [START run_keys_dag]
    with DAG(
        dag_id,
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        params=idempotency_params(),
        tags=["idempotency", "test"],
    ) as dag:
        previous = None
        for task_id in task_ids:
            task = IdempotentRunOperator(task_id=task_id, python_callable=count_rows)
            if previous is not None:
                previous >> task
            previous = task
    # [END run_keys_dag]
    globals()[dag_id] = dag
