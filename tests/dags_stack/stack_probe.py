"""Throw-away DAG for tests/stack/test_airflow_stack.py: one task appends a line to a file."""

from __future__ import annotations

import os
from datetime import datetime, timezone

from airflow.sdk import DAG, get_current_context, task

with DAG(
    dag_id="stack_probe",
    schedule="@daily",
    start_date=datetime(2026, 10, 1, tzinfo=timezone.utc),
    catchup=False,
    tags=["test"],
):

    @task
    def write_line() -> None:
        """Append "<run_id> <logical_date> <try_number>" to the file named by STACK_PROBE_OUT."""
        ctx = get_current_context()
        line = f"{ctx['run_id']} {ctx['dag_run'].logical_date} {ctx['ti'].try_number}\n"
        with open(os.environ["STACK_PROBE_OUT"], "a", encoding="utf-8") as fh:
            fh.write(line)

    write_line()
