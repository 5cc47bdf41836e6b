"""Every difference between the Airflow lines this provider supports (2.11 and 3.x).

The official providers' ``version_compat.py`` habit: names come from
``airflow.providers.common.compat.sdk`` where it maps them, and the few things it does not
map are explicit branches here. No other module checks the Airflow version.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
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


def _airflow_version() -> tuple[int, int, int]:
    from airflow import __version__
    from packaging.version import Version

    version = Version(__version__)
    return version.major, version.minor, version.micro


AIRFLOW_VERSION = _airflow_version()
AIRFLOW_V_3_0_PLUS = AIRFLOW_VERSION >= (3, 0, 0)

if AIRFLOW_V_3_0_PLUS:
    from airflow.sdk import ObjectStoragePath
    from airflow.sdk.exceptions import AirflowRescheduleException
else:  # common-compat does not map them
    from airflow.exceptions import AirflowRescheduleException
    from airflow.io.path import ObjectStoragePath

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


def run_key_links() -> tuple[BaseOperatorLink, ...]:
    """The operator's extra links: "Run key" on 3.x, none on 2.x.

    The Run keys view exists only in the Airflow 3 UI, where the worker computes a link when
    the task ends (links.py). Airflow 2's webserver would have to find the link class among
    its plugins' links to deserialize the DAG, and would link to a page it does not have.
    """
    if not AIRFLOW_V_3_0_PLUS:
        return ()
    from airflow_idempotency.links import RunKeyLink

    return (RunKeyLink(),)


BACKFILL_COMMAND = "backfill-create" if AIRFLOW_V_3_0_PLUS else "dags-backfill"
"""This line's date-range command: ``airflow backfill create`` (3.x), ``airflow dags
backfill`` (2.x; removed in 3.0)."""


def load_dag(dag_id: str, dags_folder: str | None = None) -> Any:
    """``dag_id`` parsed from ``dags_folder`` (default: ``[core] dags_folder``), as the
    line's DAG processor parses it; ``LookupError`` naming the folder's DAGs if absent."""
    if AIRFLOW_V_3_0_PLUS:
        import pathlib

        from airflow.configuration import conf
        from airflow.dag_processing.dagbag import BundleDagBag

        # As the dags-folder bundle parses it: with the folder on sys.path, so that a DAG
        # file's own modules import (the plain DagBag of 3.x does not add it).
        folder = pathlib.Path(dags_folder or conf.get("core", "dags_folder"))
        bag = BundleDagBag(dag_folder=str(folder), bundle_path=folder, bundle_name="dags-folder")
    else:
        from airflow.models.dagbag import DagBag

        bag = DagBag(dag_folder=dags_folder)
    if dag_id not in bag.dags:
        errors = f"; import errors: {sorted(bag.import_errors)}" if bag.import_errors else ""
        raise LookupError(
            f"no DAG {dag_id!r} in {bag.dag_folder} (DAGs there: {sorted(bag.dags)}{errors})"
        )
    return bag.dags[dag_id]


def backfill_logical_dates(
    dag: Any, from_date: datetime.datetime, to_date: datetime.datetime
) -> list[datetime.datetime]:
    """The logical dates of the runs this line's backfill command would create for ``dag``
    between ``from_date`` and ``to_date``: both lines compare the bounds with logical dates
    (from the DAG's own timetable); Airflow 3 also leaves out runs whose interval has not
    ended yet."""
    if AIRFLOW_V_3_0_PLUS:
        from airflow.serialization.serialized_objects import DagSerialization

        scheduler_dag = DagSerialization.from_dict(DagSerialization.to_dict(dag))
        now = datetime.datetime.now(datetime.timezone.utc)
        return [
            info.logical_date
            for info in scheduler_dag.iter_dagrun_infos_between(from_date, to_date)
            if info.logical_date is not None and info.data_interval and info.data_interval.end < now
        ]
    return [info.logical_date for info in dag.iter_dagrun_infos_between(from_date, to_date)]


class AirflowMetrics:
    """:class:`airflow_idempotency.metrics.Metrics` through Airflow's own ``Stats`` (StatsD
    or OpenTelemetry, whatever ``[metrics]`` configures; nothing when it is off)."""

    def incr(self, stat: str, count: int = 1, *, tags: Mapping[str, str] | None = None) -> None:
        Stats.incr(stat, count, tags=dict(tags or {}))

    def timing(
        self, stat: str, dt: datetime.timedelta, *, tags: Mapping[str, str] | None = None
    ) -> None:
        Stats.timing(stat, dt, tags=dict(tags or {}))


AIRFLOW_METRICS = AirflowMetrics()


def logs_to_stderr() -> None:
    """Move Airflow's console log handlers from stdout to stderr (2.x logs to stdout).

    For the CLI: its ``--json`` output on stdout must hold the JSON only.
    """
    import logging
    import sys

    loggers = [logging.getLogger()]
    loggers += [
        logger
        for logger in logging.Logger.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if hasattr(handler, "_use_stderr"):  # Airflow's RedirectStdHandler
                handler._use_stderr = True
            elif isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                handler.setStream(sys.stderr)


__all__ = [
    "AIRFLOW_METRICS",
    "AIRFLOW_V_3_0_PLUS",
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
    "run_key_links",
    "task_decorator_factory",
]
