"""A nightly DAG written without the provider: nothing here imports airflow_idempotency.

Its tag ``nightly`` is what puts it under the contract, when ``[idempotency]
policy_dag_tags`` names it (docs/policy.md). Each task that does work notes it in the file
``POLICY_WORK_LOG`` names (one line per execution), so a test counts what really ran.
"""

from __future__ import annotations

import os

import pendulum
from airflow.providers.common.compat.sdk import DAG, task
from airflow.providers.common.compat.standard.operators import PythonOperator


def _note(what: str, ds: str | None) -> None:
    path = os.environ.get("POLICY_WORK_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{what} {ds}\n")


def extract(ds: str | None = None, **_: object) -> dict[str, object]:
    _note("extract", ds)
    return {"rows": 3, "ds": ds}


with DAG(
    "nightly_sales",
    schedule="0 1 * * *",
    start_date=pendulum.datetime(2026, 9, 1, tz="UTC"),
    catchup=False,
    tags=["nightly", "sales"],
):
    raw = PythonOperator(task_id="extract", python_callable=extract)

    @task
    def load(extracted: dict[str, object], ds: str | None = None) -> object:
        _note("load", ds)
        if extracted.get("rows") != 3:  # the no-op's replayed return value must arrive
            raise ValueError(f"extract's return value did not arrive: {extracted!r}")
        return extracted["rows"]

    @task(params={"idempotency_exempt": True})
    def notify(ds: str | None = None) -> None:
        _note("notify", ds)

    load(raw.output) >> notify()
