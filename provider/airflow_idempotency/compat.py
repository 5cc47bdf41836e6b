"""The differences between the Airflow lines supported: flags, moved names, version branches.

Every difference between the Airflow lines this provider supports (2.11, 3.1 to 3.3): the
version flags, the names each line keeps elsewhere, and the few version branches.

The official providers' ``version_compat.py`` habit: names come from
``airflow.providers.common.compat.sdk`` where it maps them, and the few things it does not
map are explicit branches here. No other module checks the Airflow version: they branch on
these flags at most.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow.exceptions import AirflowNotFoundException as _CoreNotFound  # type: ignore[attr-defined]
from airflow.providers.common.compat.sdk import (
    AirflowException,
    AirflowFailException,
    AirflowNotFoundException,
    AirflowSkipException,
    BaseHook,
    BaseOperator,
    BaseOperatorLink,
    Context,
    DecoratedOperator,
    Param,
    Stats,
    TaskDecorator,
    TaskDeferred,
    task_decorator_factory,
)


def _airflow_version() -> tuple[int, int, int]:
    from airflow import __version__
    from packaging.version import Version

    version = Version(__version__)
    return version.major, version.minor, version.micro


AIRFLOW_VERSION = _airflow_version()
AIRFLOW_V_3_0_PLUS = AIRFLOW_VERSION >= (3, 0, 0)
AIRFLOW_V_3_1_PLUS = AIRFLOW_VERSION >= (3, 1, 0)
AIRFLOW_V_3_2_PLUS = AIRFLOW_VERSION >= (3, 2, 0)
"""Partitioned runs (AIP-76): ``dag_run.partition_key`` / ``partition_date``, partitioned
timetables, partition keys on asset events."""

if AIRFLOW_V_3_0_PLUS:
    from airflow.sdk import ObjectStoragePath
else:  # common-compat does not map it
    from airflow.io.path import ObjectStoragePath
if AIRFLOW_V_3_2_PLUS:
    from airflow.sdk.exceptions import AirflowRescheduleException
else:  # 2.11 and 3.1 keep it in core (their task runners catch that one); common-compat
    # does not map it
    from airflow.exceptions import AirflowRescheduleException

AIRFLOW_NOT_FOUND: tuple[type[Exception], ...] = tuple(
    dict.fromkeys((AirflowNotFoundException, _CoreNotFound))
)
"""Airflow's not-found exception (e.g. a connection that is not defined), as the line
raises it: the Task SDK's class and core's (one class on 3.3, and on 2.11 core's alone)."""

# dag_run.run_type -> job_runs.triggered_by. Asset-triggered runs are "dataset_triggered"
# on 2.x.
TRIGGERED_BY = {
    "scheduled": "scheduled",
    "manual": "manual",
    "backfill": "backfill",
    "asset_triggered": "asset-triggered",
    "asset_materialization": "asset-triggered",
    "dataset_triggered": "asset-triggered",
    "operator_triggered": "operator-triggered",
}


def run_type(dag_run: Any) -> str:
    """The run's type as text (an enum on 3.x, a string on 2.x)."""
    value = dag_run.run_type
    return str(getattr(value, "value", value))


def triggering_user(dag_run: Any) -> str | None:
    """Who triggered the run: 3.x records the user's name; 2.x records no user at all."""
    return getattr(dag_run, "triggering_user_name", None) if AIRFLOW_V_3_0_PLUS else None


def run_partition(context: Mapping[str, Any]) -> tuple[str | None, datetime.datetime | None]:
    """The run's partition key and partition date; ``(None, None)`` before 3.2 (no
    partitions: the run key comes from the logical date or the conf, as always)."""
    if not AIRFLOW_V_3_2_PLUS:
        return None, None
    dag_run = context["dag_run"]
    key = context.get("partition_key", getattr(dag_run, "partition_key", None))
    date = context.get("partition_date", getattr(dag_run, "partition_date", None))
    return key, date


@dataclass(frozen=True)
class AirflowRun:
    """What the operator reads of its run from Airflow's task context, the same way on
    every line (:func:`airflow_run`)."""

    run_type: str  # manual, scheduled, backfill, asset_triggered, ...
    triggered_by: str  # job_runs.triggered_by
    triggering_user: str | None
    logical_date: datetime.datetime | None
    partition_key: str | None
    partition_date: datetime.datetime | None


def airflow_run(context: Mapping[str, Any]) -> AirflowRun:
    """The run of this task execution, read from ``context`` once."""
    dag_run = context["dag_run"]
    kind = run_type(dag_run)
    partition_key, partition_date = run_partition(context)
    return AirflowRun(
        run_type=kind,
        triggered_by=TRIGGERED_BY.get(kind, kind),
        triggering_user=triggering_user(dag_run),
        logical_date=context.get("logical_date") or dag_run.logical_date,
        partition_key=partition_key,
        partition_date=partition_date,
    )


def add_partition_event(context: Mapping[str, Any], outlets: Any, partition_key: str) -> None:
    """Make the success's asset events of ``outlets`` carry ``partition_key`` instead of the
    run's own (3.2+: ``outlet_events[asset].add_partitions``); nothing before 3.2."""
    if not AIRFLOW_V_3_2_PLUS:
        return
    for asset in outlets or ():
        if type(asset).__name__ == "Asset":
            context["outlet_events"][asset].add_partitions([partition_key])


def reschedule_count(context: Context) -> int:
    """How many times this try of the task was rescheduled so far.

    3.x puts it in the context. 2.x does not (``lock_timeout`` would never fire), so the
    task's own TaskReschedule rows of this try are counted, in one query.
    """
    if AIRFLOW_V_3_0_PLUS:
        return int(context.get("task_reschedule_count") or 0)
    from airflow.models.taskreschedule import TaskReschedule
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    ti = context["ti"]
    with create_session() as session:
        count = session.scalar(
            select(func.count())
            .select_from(TaskReschedule)
            .where(
                TaskReschedule.dag_id == ti.dag_id,
                TaskReschedule.task_id == ti.task_id,
                TaskReschedule.run_id == ti.run_id,
                TaskReschedule.map_index == ti.map_index,
                TaskReschedule.try_number == ti.try_number,
            )
        )
    return int(count or 0)


class ReschedulingOperator(BaseOperator):
    """A BaseOperator whose AirflowRescheduleException waits until the date it names.

    On 3.x every operator can reschedule. On 2.x only a task with ``reschedule = True``
    and the ReadyToRescheduleDep (what sensors in reschedule mode have) waits; any other
    is queued again at once, so a locked key would be retried in a tight loop.
    """

    if not AIRFLOW_V_3_0_PLUS:
        from airflow.ti_deps.deps.ready_to_reschedule import ReadyToRescheduleDep

        reschedule = True
        deps = BaseOperator.deps | {ReadyToRescheduleDep()}
        del ReadyToRescheduleDep

        @classmethod
        def get_serialized_fields(cls) -> frozenset[str]:
            return super().get_serialized_fields() | {"reschedule"}  # type: ignore[no-untyped-call]


BACKFILL_COMMAND = "backfill-create" if AIRFLOW_V_3_0_PLUS else "dags-backfill"
"""This line's date-range command: ``airflow backfill create`` (3.x), ``airflow dags
backfill`` (2.x; removed in 3.0)."""


def dag_bag(dags_folder: str | None = None) -> Any:
    """The DagBag of ``dags_folder`` (default: ``[core] dags_folder``), parsed as the line's
    DAG processor parses the dags-folder bundle: with the folder on ``sys.path`` on 3.x, so
    that a DAG file's own modules import (the plain DagBag of 3.x does not add it)."""
    if not AIRFLOW_V_3_0_PLUS:
        from airflow.models.dagbag import DagBag

        return DagBag(dag_folder=dags_folder)
    import pathlib

    from airflow.configuration import conf

    folder = pathlib.Path(dags_folder or conf.get("core", "dags_folder"))
    if AIRFLOW_V_3_2_PLUS:  # moved to airflow.dag_processing by apache/airflow PR #55139
        from airflow.dag_processing.dagbag import BundleDagBag

        return BundleDagBag(dag_folder=str(folder), bundle_path=folder, bundle_name="dags-folder")
    from airflow.models.dagbag import BundleDagBag  # type: ignore[no-redef]  # 3.1

    return BundleDagBag(dag_folder=str(folder), bundle_path=folder)


def load_dag(dag_id: str, dags_folder: str | None = None) -> Any:
    """``dag_id`` parsed from ``dags_folder`` (default: ``[core] dags_folder``), as the
    line's DAG processor parses it; ``LookupError`` naming the folder's DAGs if absent."""
    bag = dag_bag(dags_folder)
    if dag_id not in bag.dags:
        errors = f"; import errors: {sorted(bag.import_errors)}" if bag.import_errors else ""
        raise LookupError(
            f"no DAG {dag_id!r} in {bag.dag_folder} (DAGs there: {sorted(bag.dags)}{errors})"
        )
    return bag.dags[dag_id]


def scheduler_dag(dag: Any) -> Any:
    """``dag`` as the line's scheduler (and its backfill command) iterates its runs: the DAG
    itself on 2.x; on 3.x its serialized form (``DagSerialization`` from 3.2,
    ``SerializedDAG`` on 3.1, where the scheduler's DAG is the SerializedDAG itself)."""
    if not AIRFLOW_V_3_0_PLUS:
        return dag
    if AIRFLOW_V_3_2_PLUS:
        from airflow.serialization.serialized_objects import DagSerialization as serializer
    else:  # 3.1
        from airflow.serialization.serialized_objects import (  # type: ignore[assignment]
            SerializedDAG as serializer,
        )
    return serializer.from_dict(serializer.to_dict(dag))


def schedule_of(dag: Any) -> Any:
    """What the DAG file gave as its schedule (a cron string, a timetable, ...):
    ``schedule`` on 3.x, ``schedule_interval`` on 2.x."""
    return getattr(dag, "schedule", None) if AIRFLOW_V_3_0_PLUS else dag.schedule_interval


__all__ = [
    "AIRFLOW_NOT_FOUND",
    "AIRFLOW_V_3_0_PLUS",
    "AIRFLOW_V_3_2_PLUS",
    "AirflowException",
    "AirflowFailException",
    "AirflowRescheduleException",
    "AirflowRun",
    "AirflowSkipException",
    "BaseHook",
    "BaseOperator",
    "BaseOperatorLink",
    "Context",
    "DecoratedOperator",
    "ObjectStoragePath",
    "Param",
    "ReschedulingOperator",
    "Stats",
    "TaskDecorator",
    "TaskDeferred",
    "add_partition_event",
    "airflow_run",
    "run_partition",
    "task_decorator_factory",
]
