"""What a run would do, read from the DAG itself: backfill runs, run keys, due keys.

The runs a backfill command would create (:func:`backfill_runs`, either line's command), the
run keys of its idempotent tasks (``airflow-idempotency explain``), the runs a backfill would
create with the state of each key (``airflow-idempotency plan``), and the keys a DAG's schedule
has made due (``gaps --dag`` and the watch DAG: a weekday-only job's weekends are no gaps).

Imports Airflow (it parses the DAG file); the CLI imports this module only for the
commands that need it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from airflow_idempotency._sql import query_rows
from airflow_idempotency.compat import (
    AIRFLOW_V_3_0_PLUS,
    BACKFILL_COMMAND,
    schedule_of,
    scheduler_dag,
)
from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.operator import IdempotentRunOperator
from airflow_idempotency.partitions import PARTITIONED_TIMETABLES, dag_partitioning

# What a run of a key does now, by its job_runs status (no row: new).
_WOULD = {"completed": "noop", "failed": "rerun", "started": "resume"}


@dataclass(frozen=True)
class Explained:
    """The run key one idempotent task of a run would get, or why it would be refused."""

    task_id: str
    job_name: str
    run_key: str | None
    explanation: str  # where the key came from, or the refusal

    def as_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "job_name": self.job_name,
            "run_key": self.run_key,
            "explanation": self.explanation,
        }


# -- the runs a backfill would create ------------------------------------------------------

BACKFILL_COMMANDS = ("backfill-create", "dags-backfill")


@dataclass(frozen=True)
class PlannedRun:
    """One run a backfill command would create: its logical date or its partition key,
    and the timetable the command's Airflow line gives the DAG (it picks the key's offset)."""

    logical_date: dt.datetime | None
    partition_key: str | None
    timetable_name: str
    fires_at: dt.datetime | None = None  # when the scheduler would start it
    partition_date: dt.datetime | None = None  # the partition's exact instant (3.2+)


def _fires_at(info: Any) -> dt.datetime | None:
    interval = getattr(info, "data_interval", None)
    if interval is not None:
        return interval.end  # type: ignore[no-any-return]
    return getattr(info, "run_after", None)


def backfill_runs(
    dag: Any,
    from_date: dt.datetime,
    to_date: dt.datetime,
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
    now = dt.datetime.now(dt.timezone.utc)
    if command != BACKFILL_COMMAND:
        return _other_line_runs(dag, from_date, to_date, command, now)
    name = type(dag.timetable).__name__
    infos = scheduler_dag(dag).iter_dagrun_infos_between(from_date, to_date)
    if not AIRFLOW_V_3_0_PLUS:
        return [PlannedRun(i.logical_date, None, name, _fires_at(i)) for i in infos]
    runs = []
    for info in infos:
        partition_key = getattr(info, "partition_key", None)
        if partition_key is not None and info.run_after <= now:
            date = getattr(info, "partition_date", None)
            runs.append(PlannedRun(None, partition_key, name, _fires_at(info), date))
        elif info.logical_date is not None and info.data_interval and info.data_interval.end < now:
            runs.append(PlannedRun(info.logical_date, None, name, _fires_at(info)))
    return runs


def _other_line_runs(
    dag: Any,
    from_date: dt.datetime,
    to_date: dt.datetime,
    command: str,
    now: dt.datetime,
) -> list[PlannedRun]:
    partitioned, _ = dag_partitioning(dag)
    if partitioned or type(dag.timetable).__name__ in PARTITIONED_TIMETABLES:
        raise InvalidInputError(
            f"DAG {dag.dag_id!r} is partitioned: Airflow 2 has no partitioned runs, so "
            f"`airflow dags backfill` cannot run it; plan it with --command backfill-create"
        )
    cron = schedule_of(dag)
    if not isinstance(cron, str):  # an explicit timetable: the same on both lines
        infos = timetable_runs(dag.timetable, from_date, to_date)
        name = type(dag.timetable).__name__
    else:
        from airflow.timetables.interval import CronDataIntervalTimetable
        from airflow.timetables.trigger import CronTriggerTimetable

        if command == "dags-backfill":
            other: Any = CronDataIntervalTimetable(cron, dag.timezone)
        else:
            other = CronTriggerTimetable(cron, timezone=dag.timezone)
        infos = timetable_runs(other, from_date, to_date)
        name = type(other).__name__
    if command == "backfill-create":
        infos = [i for i in infos if i.data_interval is not None and i.data_interval.end < now]
    return [PlannedRun(i.logical_date, None, name, _fires_at(i)) for i in infos]


def timetable_runs(timetable: Any, first: dt.datetime, last: dt.datetime) -> list[Any]:
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


# -- the run keys of a DAG's tasks --------------------------------------------------------


def idempotent_tasks(dag: Any) -> list[IdempotentRunOperator]:
    """The tasks of ``dag`` that run under the contract, in task id order; a mapped one
    once per ``key_segment`` it expands over (when the list is in the DAG file)."""
    found: list[IdempotentRunOperator] = []
    for task in sorted(dag.tasks, key=lambda t: t.task_id):
        if isinstance(task, IdempotentRunOperator):
            found.append(task)
        elif isinstance(getattr(task, "operator_class", None), type) and issubclass(
            task.operator_class, IdempotentRunOperator
        ):
            found += _unmapped(task)
    return found


def _unmapped(mapped: Any) -> list[IdempotentRunOperator]:
    """A mapped task as one operator per literal ``key_segment``; one without a segment when
    the segments come from upstream data (unknown until the run)."""
    expanded = getattr(getattr(mapped, "expand_input", None), "value", None) or {}
    segments = expanded.get("key_segment")
    if not isinstance(segments, list | tuple):
        return [mapped.unmap({})]
    return [mapped.unmap({"key_segment": segment}) for segment in segments]


def require_idempotent(dag: Any) -> list[IdempotentRunOperator]:
    tasks = idempotent_tasks(dag)
    if not tasks:
        raise InvalidInputError(
            f"DAG {dag.dag_id!r} has no IdempotentRunOperator (or @task.idempotent_run) task: "
            "there is no run key to explain or plan"
        )
    return tasks


def explain(
    dag: Any,
    *,
    kind: str,
    logical_date: dt.datetime | None,
    conf: Mapping[str, Any],
    partition_key: str | None = None,
    timetable_name: str | None = None,
    partition_date: dt.datetime | None = None,
) -> list[Explained]:
    """The run key of each idempotent task of a ``kind`` run at ``logical_date`` (or of the
    partition ``partition_key``, at the instant ``partition_date`` when known: it tells the
    two 02:00 hours of an autumn night apart); ``timetable_name``: as if the DAG had that
    timetable (the other Airflow line's for a cron string)."""
    result = []
    for task in require_idempotent(dag):
        try:
            resolved = task.explain_run_key(
                kind=kind,
                logical_date=logical_date,
                conf=conf,
                partition_key=partition_key,
                timetable_name=timetable_name,
                partition_date=partition_date,
            )
        except InvalidInputError as exc:
            result.append(Explained(task.task_id, task.effective_job_name, None, str(exc)))
        else:
            result.append(
                Explained(
                    task.task_id, task.effective_job_name, resolved.run_key, resolved.explanation
                )
            )
    return result


def plan(
    dag: Any,
    conn: psycopg.Connection | None,
    schema: str,
    from_date: dt.datetime,
    to_date: dt.datetime,
    command: str = BACKFILL_COMMAND,
) -> list[dict[str, Any]]:
    """For each run ``command`` would create between the two bounds (this line's backfill
    command by default, or the other line's), the business key of each idempotent task and
    what a run of it would do now: ``noop`` (completed), ``rerun`` (failed), ``resume``
    (started: in progress or abandoned), ``locked`` (another execution holds it now) or
    ``new``; ``refused`` with the reason when the key would be refused. Runs of a
    partitioned DAG are named by their ``partition_key``. ``conn`` ``None``: nothing has
    run yet, every key is new."""
    require_idempotent(dag)
    rows: list[dict[str, Any]] = []
    for run in backfill_runs(dag, from_date, to_date, command):
        explained = explain(
            dag,
            kind="backfill",
            logical_date=run.logical_date,
            conf={},
            partition_key=run.partition_key,
            timetable_name=run.timetable_name,
            partition_date=run.partition_date,
        )
        for item in explained:
            rows.append(
                {"logical_date": run.logical_date, "partition_key": run.partition_key}
                | {"partition_date": run.partition_date}
                | item.as_dict()
            )
    keyed = [r for r in rows if r["run_key"] is not None]
    pairs = [(r["job_name"], r["run_key"]) for r in keyed]
    states = _states(conn, schema, pairs) if conn is not None else {}
    for row in rows:
        if row["run_key"] is None:
            row["would"] = "refused"
            continue
        status, locked = states.get((row["job_name"], row["run_key"]), (None, False))
        row["status"] = status
        row["would"] = "locked" if locked else _WOULD.get(status or "", "new")
    return rows


def due_keys(dag: Any, first: dt.datetime, as_of: dt.datetime) -> dict[str, set[str]]:
    """Per job of ``dag``, the run keys of the runs its schedule had started between
    ``first`` and ``as_of`` (a run that fires after ``as_of`` is not due yet). A
    weekday-only cron has no weekend keys; nothing before the DAG's start_date is due.
    A partitioned DAG's keys follow when each partition's run fires (its cron tick; the
    partition is that tick moved by ``run_offset``). Keys that only a manual run or a
    data-driven segment makes are not known here."""
    due: dict[str, set[str]] = {}
    for run in scheduled_runs(dag, first, as_of):
        for item in explain(
            dag,
            kind="scheduled",
            logical_date=run.logical_date,
            conf={},
            partition_key=run.partition_key,
            partition_date=run.partition_date,
        ):
            if item.run_key is not None:
                due.setdefault(item.job_name, set()).add(item.run_key)
    return due


def scheduled_runs(dag: Any, first: dt.datetime, as_of: dt.datetime) -> list[PlannedRun]:
    """The runs the scheduler starts for ``dag`` from ``first`` (or its start_date, if
    later) to ``as_of`` (or its end_date), each with when it fires.

    A partitioned timetable is walked on its scheduling path (``next_dagrun_info_v2``):
    there a run fires at its cron tick and carries the partition of that tick moved by
    ``run_offset``, while a backfill's run of the same partition says it runs at the
    partition date (:func:`backfill_runs`).
    """
    start = getattr(dag, "start_date", None)
    end = getattr(dag, "end_date", None)
    earliest = max(first, start) if start is not None else first
    latest = min(as_of, end) if end is not None else as_of
    partitioned, _ = dag_partitioning(dag)
    if not partitioned:
        runs = backfill_runs(dag, earliest, latest) if earliest <= latest else []
        return [r for r in runs if r.fires_at is None or r.fires_at <= as_of]
    import pendulum
    from airflow.timetables.base import TimeRestriction

    timetable = scheduler_dag(dag).timetable
    restriction = TimeRestriction(
        earliest=pendulum.instance(earliest), latest=pendulum.instance(latest), catchup=True
    )
    name = type(dag.timetable).__name__
    runs, info = [], None
    while len(runs) < 100_000:
        info = timetable.next_dagrun_info_v2(last_dagrun_info=info, restriction=restriction)
        if info is None or info.partition_key is None:
            return runs
        runs.append(PlannedRun(None, info.partition_key, name, info.run_after, info.partition_date))
    raise InvalidInputError(f"{first} .. {as_of} is more than 100,000 runs: narrow the range")


def _states(
    conn: psycopg.Connection, schema: str, pairs: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], tuple[str | None, bool]]:
    if not pairs:
        return {}
    params = {
        "jobs": [job for job, _ in pairs],
        "keys": [key for _, key in pairs],
        "lock_keys": [run_lock_key(job, key) for job, key in pairs],
    }
    found = query_rows(conn, "plan_states", schema, params)
    return {(r["job_name"], r["run_key"]): (r["status"], r["locked"]) for r in found}
