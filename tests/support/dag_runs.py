"""Run DAGs defined in tests through Airflow's real ``dag.test()`` code path, on either line."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import pendulum
import pytest
from airflow.providers.common.compat.sdk import DAG
from airflow.timetables.trigger import CronTriggerTimetable
from airflow.utils.state import DagRunState

from airflow_idempotency import compat
from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS
from devtools.invariants import fire_time

_ARG_NOT_SET = object()

airflow3_only = pytest.mark.skipif(
    not AIRFLOW_V_3_0_PLUS, reason="Airflow 3 only: Airflow 2 gives every run a logical date"
)


def daily_trigger() -> CronTriggerTimetable:
    """``@daily`` as Airflow 3 builds it from a cron string, on both lines (the run fired at
    D+1 00:00 has logical date D+1): tests that map logical dates to keys use it so that one
    expectation holds on 2.11 and 3.x. Airflow 2's own default is tested separately."""
    return CronTriggerTimetable("0 0 * * *", timezone="UTC")


def daily_dag(dag_id: str, **kwargs: Any) -> DAG:
    """A DAG run daily at midnight (:func:`daily_trigger`) from 2026-01-01, no catchup."""
    start = pendulum.datetime(2026, 1, 1, tz="UTC")
    return DAG(dag_id, schedule=daily_trigger(), start_date=start, catchup=False, **kwargs)


def scheduled_logical_date(business_date: str, at: str = "01:00") -> str:
    """The logical date of the scheduled run of a daily cron DAG (``M H * * *``) that
    processes ``business_date``: the run fires at D+1 ``at``; on Airflow 3 (a
    CronTriggerTimetable) its logical date is that moment, on Airflow 2 (a
    CronDataIntervalTimetable) the start of its interval, D ``at``."""
    return fire_time(business_date, at, interval_start=not AIRFLOW_V_3_0_PLUS)


def load_dag_bag(folder: Path) -> Any:
    """The DagBag of ``folder``, as the line's DAG processor builds it."""
    return compat.dag_bag(str(folder))


def register(dag: DAG) -> None:
    """Serialize ``dag`` into the metadata DB (Airflow 3's dag.test only runs serialized DAGs).

    Airflow's own modules for it moved between the 3.x lines (apache/airflow PR #55139)."""
    if not AIRFLOW_V_3_0_PLUS:
        return
    from airflow.dag_processing.bundles.manager import DagBundlesManager

    DagBundlesManager().sync_bundles_to_db()  # type: ignore[no-untyped-call]
    if compat.AIRFLOW_V_3_2_PLUS:
        from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    else:
        from airflow.models.dagbag import DagBag  # type: ignore[no-redef]
    bag = DagBag(dag_folder=os.devnull, collect_dags=False)
    bag.bag_dag(dag)
    if compat.AIRFLOW_V_3_2_PLUS:
        sync_bag_to_db(bag, "dags-folder", None)
    else:  # 3.1
        from airflow.models.dagbag import sync_bag_to_db as sync_31

        sync_31(bag, "dags-folder", None)


def run_dag(dag: DAG, logical_date: Any = _ARG_NOT_SET, conf: dict[str, Any] | None = None) -> Any:
    """Register and run ``dag`` once with dag.test(); return the DagRun.

    ``logical_date=None`` is a manual run without a date on Airflow 3; Airflow 2 gives every
    run one, and its dag.test() then uses the current time.
    """
    kwargs: dict[str, Any] = {"run_conf": conf}
    if AIRFLOW_V_3_0_PLUS:
        register(dag)
        if logical_date is not _ARG_NOT_SET:
            kwargs["logical_date"] = logical_date
        return dag.test(**kwargs)
    # A second dag.test of one DAG and date looks up the FAB user table: import its models.
    import airflow.providers.fab.auth_manager.models  # noqa: F401

    if logical_date not in (_ARG_NOT_SET, None):
        kwargs["execution_date"] = logical_date
    return dag.test(**kwargs)


def task_states(dag_run: Any) -> dict[str, str]:
    """task_id -> state of the run's task instances."""
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


def utc(year: int, month: int, day: int, hour: int = 0) -> dt.datetime:
    return dt.datetime(year, month, day, hour, tzinfo=dt.timezone.utc)


SUCCESS = DagRunState.SUCCESS
FAILED = DagRunState.FAILED
