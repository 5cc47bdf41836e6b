"""Every difference between the Airflow lines this provider supports (2.11, 3.1 to 3.3).

The official providers' ``version_compat.py`` habit: names come from
``airflow.providers.common.compat.sdk`` where it maps them, and the few things it does not
map are explicit branches here. No other module checks the Airflow version.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow.providers.common.compat.sdk import (
    AirflowException,
    AirflowFailException,
    AirflowSkipException,
    BaseHook,
    BaseOperator,
    BaseOperatorLink,
    Context,
    DecoratedOperator,
    Param,
    Stats,
    TaskDecorator,
    task_decorator_factory,
)

from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.run_key import PartitionSpec


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


def run_partition(context: Mapping[str, Any]) -> tuple[str | None, datetime.datetime | None]:
    """The run's partition key and partition date; ``(None, None)`` before 3.2 (no
    partitions: the run key comes from the logical date or the conf, as always)."""
    if not AIRFLOW_V_3_2_PLUS:
        return None, None
    dag_run = context["dag_run"]
    key = context.get("partition_key", getattr(dag_run, "partition_key", None))
    date = context.get("partition_date", getattr(dag_run, "partition_date", None))
    return key, date


_PARTITIONED_TIMETABLES = frozenset({"CronPartitionTimetable", "PartitionedAssetTimetable"})


def dag_partitioning(dag: Any) -> tuple[bool, PartitionSpec]:
    """Whether ``dag`` makes partitioned runs, and how its timetable writes partition keys
    (the SDK classes of 3.2+: CronPartitionTimetable's ``key_format`` and timezone, the
    partition mappers of a PartitionedAssetTimetable). Never partitioned before 3.2."""
    timetable = getattr(dag, "timetable", None) if dag is not None else None
    if not AIRFLOW_V_3_2_PLUS or timetable is None:
        return False, PartitionSpec()
    # The Task SDK's timetable classes (what a DAG file builds) have no ``partitioned``
    # attribute; the scheduler's have. Either way, these are the partitioned ones.
    partitioned = bool(
        getattr(timetable, "partitioned", False)
        or getattr(timetable, "partitioned_at_runtime", False)
        or type(timetable).__name__ in _PARTITIONED_TIMETABLES
    )
    formats: list[str] = []
    zones: list[str] = []
    delimiters: list[str] = []
    if isinstance(getattr(timetable, "key_format", None), str):  # CronPartitionTimetable
        formats.append(timetable.key_format)
        zones.append(_zone_name(getattr(timetable, "timezone", None)))
    mappers = list((getattr(timetable, "partition_mapper_config", None) or {}).values())
    if getattr(timetable, "default_partition_mapper", None) is not None:
        mappers.append(timetable.default_partition_mapper)
    for mapper in mappers:
        _walk_mapper(mapper, formats, zones, delimiters)
    zone = zones[0] if zones and all(z == zones[0] for z in zones) else None
    delimiter = delimiters[0] if delimiters else PartitionSpec.delimiter
    return partitioned, PartitionSpec(tuple(dict.fromkeys(formats)), zone, delimiter)


def _walk_mapper(mapper: Any, formats: list[str], zones: list[str], delimiters: list[str]) -> None:
    """Collect what a partition mapper writes: temporal mappers' output formats and
    timezones, ProductMapper's delimiter, through Chain, Rollup and FanOut mappers."""
    if isinstance(getattr(mapper, "output_format", None), str):
        formats.append(mapper.output_format)
        zones.append(_zone_name(getattr(mapper, "_timezone", None)))
    if isinstance(getattr(mapper, "delimiter", None), str):
        delimiters.append(mapper.delimiter)
    children = list(getattr(mapper, "mappers", None) or [])
    children += [getattr(mapper, a, None) for a in ("upstream_mapper", "downstream_mapper")]
    for child in children:
        if child is not None:
            _walk_mapper(child, formats, zones, delimiters)


def _zone_name(zone: Any) -> str:
    return str(getattr(zone, "name", None) or zone or "UTC")


def add_partition_event(context: Mapping[str, Any], outlets: Any, partition_key: str) -> None:
    """Make the success's asset events of ``outlets`` carry ``partition_key`` instead of the
    run's own (3.2+: ``outlet_events[asset].add_partitions``); nothing before 3.2."""
    if not AIRFLOW_V_3_2_PLUS:
        return
    for asset in outlets or ():
        if type(asset).__name__ == "Asset":
            context["outlet_events"][asset].add_partitions([partition_key])


def triggering_user(dag_run: Any) -> str | None:
    """Who triggered the run: 3.x records the user's name; 2.x records no user at all."""
    return getattr(dag_run, "triggering_user_name", None) if AIRFLOW_V_3_0_PLUS else None


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


BACKFILL_COMMANDS = ("backfill-create", "dags-backfill")


@dataclass(frozen=True)
class PlannedRun:
    """One run a backfill command would create: its logical date or its partition key,
    and the timetable the command's Airflow line gives the DAG (it picks the key's offset)."""

    logical_date: datetime.datetime | None
    partition_key: str | None
    timetable_name: str
    fires_at: datetime.datetime | None = None  # when the scheduler would start it


def _fires_at(info: Any) -> datetime.datetime | None:
    interval = getattr(info, "data_interval", None)
    if interval is not None:
        return interval.end  # type: ignore[no-any-return]
    return getattr(info, "run_after", None)


def backfill_runs(
    dag: Any,
    from_date: datetime.datetime,
    to_date: datetime.datetime,
    command: str = BACKFILL_COMMAND,
) -> list[PlannedRun]:
    """The runs ``command`` would create for ``dag`` between the two bounds.

    Both lines compare the bounds with logical dates from the DAG's timetable (partition
    dates for a partitioned timetable, 3.2+); Airflow 3 leaves out runs whose interval has
    not ended. ``command`` may be the other line's: a cron string is then the timetable the
    other line builds for it (CronDataIntervalTimetable on 2.x, CronTriggerTimetable on
    3.x), an explicit timetable the same one; Airflow 2 has no partitioned runs.
    """
    if command not in BACKFILL_COMMANDS:
        raise InvalidInputError(f"unknown command {command!r}: use one of {BACKFILL_COMMANDS}")
    now = datetime.datetime.now(datetime.timezone.utc)
    if command != BACKFILL_COMMAND:
        return _other_line_runs(dag, from_date, to_date, command, now)
    name = type(dag.timetable).__name__
    if not AIRFLOW_V_3_0_PLUS:
        infos = dag.iter_dagrun_infos_between(from_date, to_date)
        return [PlannedRun(i.logical_date, None, name, _fires_at(i)) for i in infos]
    if AIRFLOW_V_3_2_PLUS:
        from airflow.serialization.serialized_objects import DagSerialization as serializer
    else:  # 3.1: the scheduler's DAG is the SerializedDAG itself
        from airflow.serialization.serialized_objects import (  # type: ignore[assignment]
            SerializedDAG as serializer,
        )
    scheduler_dag = serializer.from_dict(serializer.to_dict(dag))
    runs = []
    for info in scheduler_dag.iter_dagrun_infos_between(from_date, to_date):
        partition_key = getattr(info, "partition_key", None)
        if partition_key is not None and info.run_after <= now:
            runs.append(PlannedRun(None, partition_key, name, _fires_at(info)))
        elif info.logical_date is not None and info.data_interval and info.data_interval.end < now:
            runs.append(PlannedRun(info.logical_date, None, name, _fires_at(info)))
    return runs


def _other_line_runs(
    dag: Any,
    from_date: datetime.datetime,
    to_date: datetime.datetime,
    command: str,
    now: datetime.datetime,
) -> list[PlannedRun]:
    partitioned, _ = dag_partitioning(dag)
    if partitioned or type(dag.timetable).__name__ in _PARTITIONED_TIMETABLES:
        raise InvalidInputError(
            f"DAG {dag.dag_id!r} is partitioned: Airflow 2 has no partitioned runs, so "
            f"`airflow dags backfill` cannot run it; plan it with --command backfill-create"
        )
    cron = getattr(dag, "schedule", None) if AIRFLOW_V_3_0_PLUS else dag.schedule_interval
    if not isinstance(cron, str):  # an explicit timetable: the same on both lines
        infos = _iterate(dag.timetable, from_date, to_date)
        name = type(dag.timetable).__name__
    else:
        from airflow.timetables.interval import CronDataIntervalTimetable
        from airflow.timetables.trigger import CronTriggerTimetable

        if command == "dags-backfill":
            other: Any = CronDataIntervalTimetable(cron, dag.timezone)
        else:
            other = CronTriggerTimetable(cron, timezone=dag.timezone)
        infos = _iterate(other, from_date, to_date)
        name = type(other).__name__
    if command == "backfill-create":
        infos = [i for i in infos if i.data_interval is not None and i.data_interval.end < now]
    return [PlannedRun(i.logical_date, None, name, _fires_at(i)) for i in infos]


def _iterate(timetable: Any, first: datetime.datetime, last: datetime.datetime) -> list[Any]:
    """The timetable's runs whose logical date is within [first, last] (its public
    ``next_dagrun_info``, the same on both lines)."""
    import pendulum
    from airflow.timetables.base import TimeRestriction

    restriction = TimeRestriction(
        earliest=pendulum.instance(first), latest=pendulum.instance(last), catchup=True
    )
    infos: list[Any] = []
    previous = None
    while len(infos) < 100_000:
        info = timetable.next_dagrun_info(
            last_automated_data_interval=previous, restriction=restriction
        )
        if info is None or info.logical_date is None or info.logical_date > last:
            return infos
        infos.append(info)
        previous = info.data_interval
    raise InvalidInputError(f"{first} .. {last} is more than 100,000 runs: narrow the range")


__all__ = [
    "AIRFLOW_V_3_0_PLUS",
    "AIRFLOW_V_3_2_PLUS",
    "AirflowException",
    "AirflowFailException",
    "AirflowRescheduleException",
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
    "add_partition_event",
    "dag_partitioning",
    "run_partition",
    "task_decorator_factory",
]
