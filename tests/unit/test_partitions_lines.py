"""Partitions exist from Airflow 3.2 on; the other lines keep today's rules (run on both
lines: Airflow 3.3 and 2.11). No database: the operator's decision and the DAG files."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_idempotency.compat import AIRFLOW_V_3_2_PLUS, run_partition
from airflow_idempotency.operator import IdempotentRunOperator
from devtools.airflow_env import DAGS_FOLDER
from support.dag_runs import load_dag_bag

pytestmark = pytest.mark.both_airflow_lines

OPERATOR = IdempotentRunOperator(task_id="work", python_callable=lambda run: None)


def context(**run: Any) -> Any:
    dag_run = SimpleNamespace(conf={}, run_type="manual", **run)
    return {"dag_run": dag_run, "params": {}, "logical_date": run.get("logical_date")}


def test_a_partition_key_is_the_run_key_only_where_airflow_has_partitions() -> None:
    """A run carrying a partition key: keyed by it on 3.2+; on 2.11 (and 3.0-3.1) the
    operator never reads it and keys the run by its logical date, as before."""
    logical_date = dt.datetime(2026, 10, 5, 1, tzinfo=dt.timezone.utc)
    run = context(partition_key="2026-10-01T01:00:00", logical_date=logical_date)
    resolved = OPERATOR.resolve_run_key(run)
    if AIRFLOW_V_3_2_PLUS:
        assert run_partition(run)[0] == "2026-10-01T01:00:00"
        assert (resolved.run_key, resolved.source) == ("2026-10-01", "partition_key")
    else:
        assert run_partition(run) == (None, None)
        assert (resolved.run_key, resolved.source) == ("2026-10-05", "logical_date")


def test_the_example_dags_parse_on_every_line() -> None:
    """dags/ has no import errors on this line; the partitioned example defines its DAGs
    only where partitioned runs exist."""
    bag = load_dag_bag(DAGS_FOLDER)
    assert bag.import_errors == {}
    partitioned = {"invoice_regions", "regional_reconciliation"}
    assert (partitioned <= set(bag.dags)) == AIRFLOW_V_3_2_PLUS
    assert {"finalize_invoices", "daily_reconciliation", "idempotency_watch"} <= set(bag.dags)
