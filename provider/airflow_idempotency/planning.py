"""What a run would do, read from the DAG itself: the run keys of its idempotent tasks
(``airflow-idempotency explain``), the runs a backfill would create with the state of each
key (``airflow-idempotency plan``), and the keys a DAG's schedule has made due (``gaps
--dag`` and the watch DAG: a weekday-only job's weekends are no gaps).

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
from airflow_idempotency.compat import BACKFILL_COMMAND, backfill_runs
from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.operator import IdempotentRunOperator

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
) -> list[Explained]:
    """The run key of each idempotent task of a ``kind`` run at ``logical_date`` (or of the
    partition ``partition_key``); ``timetable_name``: as if the DAG had that timetable (the
    other Airflow line's for a cron string)."""
    result = []
    for task in require_idempotent(dag):
        try:
            resolved = task.explain_run_key(
                kind=kind,
                logical_date=logical_date,
                conf=conf,
                partition_key=partition_key,
                timetable_name=timetable_name,
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
        )
        for item in explained:
            rows.append(
                {"logical_date": run.logical_date, "partition_key": run.partition_key}
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
    Keys that only a manual run or a data-driven segment makes are not known here."""
    due: dict[str, set[str]] = {}
    for run in backfill_runs(dag, first, as_of):
        if run.fires_at is not None and run.fires_at > as_of:
            continue
        for item in explain(
            dag,
            kind="scheduled",
            logical_date=run.logical_date,
            conf={},
            partition_key=run.partition_key,
        ):
            if item.run_key is not None:
                due.setdefault(item.job_name, set()).add(item.run_key)
    return due


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
