"""Run DAGs defined in tests through Airflow's real ``dag.test()`` code path."""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from airflow.sdk import DAG
from airflow.utils.state import DagRunState

_ARG_NOT_SET = object()


def register(dag: DAG) -> None:
    """Serialize ``dag`` into the metadata DB (dag.test only runs serialized DAGs)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    DagBundlesManager().sync_bundles_to_db()
    bag = DagBag(dag_folder=os.devnull, collect_dags=False)
    bag.bag_dag(dag)
    sync_bag_to_db(bag, "dags-folder", None)


def run_dag(dag: DAG, logical_date: Any = _ARG_NOT_SET, conf: dict[str, Any] | None = None) -> Any:
    """Register and run ``dag`` once with dag.test(); return the DagRun."""
    register(dag)
    kwargs: dict[str, Any] = {"run_conf": conf}
    if logical_date is not _ARG_NOT_SET:
        kwargs["logical_date"] = logical_date
    return dag.test(**kwargs)


def task_states(dag_run: Any) -> dict[str, str]:
    """task_id -> state of the run's task instances."""
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


def utc(year: int, month: int, day: int, hour: int = 0) -> dt.datetime:
    return dt.datetime(year, month, day, hour, tzinfo=dt.timezone.utc)


SUCCESS = DagRunState.SUCCESS
FAILED = DagRunState.FAILED
