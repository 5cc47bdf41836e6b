"""The cluster policy: every task of a tagged DAG runs under the contract, by configuration.

Installed with the provider through the ``airflow.policy`` entry point (Airflow's pluggy
policies, 2.6+) and inert unless ``[idempotency] policy_dag_tags``
(``AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS``, comma-separated tags) names a tag the DAG
carries. Airflow calls :func:`dag_policy` wherever it parses a DAG file (the DAG processor,
the worker before it runs a task, ``dags test``, ``dags backfill``), so the task that runs is
the one the policy changed. For such a DAG:

- every task (classic operator or TaskFlow) gets a subclass of its own class (same name,
  same module, so the UI shows it as before) whose ``execute`` runs the original one under
  the contract: run key from the run's schedule or partition (the operator's rules,
  :mod:`airflow_idempotency.airflow_task`), lock, job name ``<dag_id>.<task_id>``, a no-op
  once completed, ``force`` / ``dry_run`` from the trigger's conf; while it executes, its run
  key and job are in the environment (:data:`RUN_KEY_ENV`, :data:`JOB_ENV`) for what it
  starts (dbt through cosmos: docs/dbt.md);
- a deferral (``TaskDeferred``) ends the attempt ``deferred`` (the run stays started, the
  lock is released, Airflow gets the exception unchanged), and ``resume_execution`` runs
  under the contract too, as a new attempt of the key: a no-op once it is completed, else
  the resumed method completes it (docs/policy.md, deferrable operators);
- left alone: tasks with ``params={"idempotency_exempt": True}`` (or :func:`exempt`),
  tasks that are already idempotent (:class:`IdempotentRunOperator`,
  ``@task.idempotent_run``), sensors, branching and short-circuit operators, and mapped
  tasks (their instances are made at run time, where a policy does not reach: use
  ``key_segment`` with the operator instead);
- a DAG whose runs have no business date (``schedule=None``, asset-triggered) or whose
  schedule fires more than once a day is refused, with the reason, as the file's import
  error: the policy keys runs by day, and two runs of one day would make the second a no-op.

This module imports only pluggy's marker at import time: Airflow loads the entry point
while it sets itself up.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import os
from collections.abc import Iterator
from typing import Any

from airflow.policies import hookimpl

CONFIG_SECTION = "idempotency"
EXEMPT_PARAM = "idempotency_exempt"
"""A task's param that leaves it out of the policy: ``params={"idempotency_exempt": True}``."""
RUN_KEY_ENV = "AIRFLOW_IDEMPOTENCY_RUN_KEY"
"""While a task under the policy executes, its run key is in this environment variable, so
that what the task starts reads it: a dbt model run by astronomer-cosmos filters and replaces
its day by it (``env_var('AIRFLOW_IDEMPOTENCY_RUN_KEY')``: docs/dbt.md), a BashOperator's
script by ``$AIRFLOW_IDEMPOTENCY_RUN_KEY``."""
JOB_ENV = "AIRFLOW_IDEMPOTENCY_JOB"
"""The job name (``<dag_id>.<task_id>``) beside :data:`RUN_KEY_ENV`."""
MAX_REPLAYED_BYTES = 65_536
"""A return value (XCom) up to this size in JSON is kept with the run and given again on a
no-op, so that a downstream task reads what the first run returned."""

_KEYED_TIMETABLES = frozenset(
    {
        "CronTriggerTimetable",
        "CronDataIntervalTimetable",
        "DeltaDataIntervalTimetable",
        "DeltaTriggerTimetable",
        "MultipleCronTriggerTimetable",
        "CronPartitionTimetable",
    }
)


_LEFT_ALONE_BASES = frozenset({"BaseSensorOperator", "SkipMixin"})
"""Sensors wait and do no work to protect. Branching and short-circuit operators (SkipMixin)
decide which tasks run by skipping the others inside their execute: a no-op of one would
skip nothing (Airflow 2), and on Airflow 3 their skip is an exception the contract would
record as a failure."""


def _setting(name: str, fallback: str) -> str:
    from airflow.configuration import conf

    return str(conf.get(CONFIG_SECTION, name, fallback=fallback) or fallback)


def policy_tags() -> frozenset[str]:
    """The tags of ``[idempotency] policy_dag_tags``; empty: the policy does nothing."""
    return frozenset(t.strip() for t in _setting("policy_dag_tags", "").split(",") if t.strip())


def exempt(task: Any) -> Any:
    """Leave ``task`` (an operator, or what a TaskFlow call returned) out of the policy."""
    operator = getattr(task, "operator", task)
    operator.params[EXEMPT_PARAM] = True
    return task


@hookimpl
def dag_policy(dag: Any) -> None:
    """Put every task of ``dag`` under the contract when it carries a configured tag."""
    tags = policy_tags()
    if not tags or not tags & set(dag.tags or ()):
        return
    from airflow.exceptions import AirflowClusterPolicyViolation

    refusal = key_refusal(dag)
    if refusal:
        raise AirflowClusterPolicyViolation(
            f"DAG {dag.dag_id!r} carries the tag(s) {sorted(tags & set(dag.tags))} of "
            f"[idempotency] policy_dag_tags, but {refusal}. Give it a daily (or slower) cron "
            "schedule or timedelta, remove the tag, or protect its tasks with "
            "IdempotentRunOperator and an explicit run_key_rule."
        )
    for task in dag.tasks:
        if covered(task):
            task.__class__ = _contract_class(type(task))  # type: ignore[arg-type]


def covered(task: Any) -> bool:
    """Whether the policy puts ``task`` of a tagged DAG under the contract."""
    from airflow_idempotency.compat import BaseOperator
    from airflow_idempotency.operator import IdempotentRunOperator

    if not isinstance(task, BaseOperator) or isinstance(task, IdempotentRunOperator):
        return False  # a mapped task, or one under the contract already
    if protected(task):
        return False  # done already (a DAG parsed twice in one process)
    if any(c.__name__ in _LEFT_ALONE_BASES for c in type(task).__mro__):
        return False
    params = task.params or {}
    return not (EXEMPT_PARAM in params and _truthy(params[EXEMPT_PARAM]))


def protected(task: Any) -> bool:
    """Whether the policy has put ``task`` under the contract (its DAG parsed with the tag
    configured)."""
    return bool(getattr(type(task), "_idempotency_policy", False))


def _truthy(value: Any) -> bool:
    value = getattr(value, "value", value)  # a Param
    return value is True or (isinstance(value, str) and value.lower() == "true")


def key_refusal(dag: Any) -> str | None:
    """Why the policy cannot give ``dag``'s runs one key per business day, or ``None``."""
    timetable = dag.timetable
    name = type(timetable).__name__
    if name not in _KEYED_TIMETABLES:
        return (
            f"its runs have no business date to key them by (timetable {name}: "
            "schedule=None or assets); only a run_key in every trigger's conf would name one"
        )
    # MultipleCronTriggerTimetable: its crons together (two daily crons fire twice a day)
    parts = getattr(timetable, "_timetables", None) or [timetable]
    expressions = [
        e
        for t in parts
        if isinstance(e := getattr(t, "expression", None) or getattr(t, "_expression", None), str)
    ]
    zone = getattr(parts[0], "_timezone", None) or dag.timezone
    for expression in expressions:
        days = _fire_days(expression, zone)
        if len(set(days)) < len(days) or _twice_on_its_first_day(expression, zone):
            return (
                f"its schedule {expression!r} fires more than once a day, and the policy keys "
                "runs by day (the day's later runs would be no-ops)"
            )
    if len(expressions) > 1:  # each once a day at most: do two of them meet on a day?
        days = [day for e in expressions for day in _fire_days(e, zone, runs=None, span=400)]
        if len(set(days)) < len(days):
            return (
                f"its schedules {expressions!r} together fire more than once a day on some "
                "days, and the policy keys runs by day (the day's later runs would be no-ops)"
            )
    delta = getattr(timetable, "_delta", None) or getattr(timetable, "delta", None)
    if delta is not None and not isinstance(delta, dt.timedelta):
        # a dateutil relativedelta: its step from a fixed day (relativedelta(hours=6))
        start = dt.datetime(2026, 1, 5)
        try:
            delta = (start + delta) - start
        except TypeError:
            delta = None
    if isinstance(delta, dt.timedelta) and delta < dt.timedelta(days=1):
        return f"its schedule fires every {delta}, more than once a day"
    return None


def _fire_days(
    expression: str, timezone: Any, runs: int | None = 8, span: int = 40, start: Any = None
) -> list[dt.date]:
    """The local days of the cron ``expression``'s first ``runs`` fire times (all, for
    ``None``) in the ``span`` days from ``start`` (2026-01-05) (Airflow's own cron timetable,
    the same on both lines)."""
    import pendulum
    from airflow.timetables.trigger import CronTriggerTimetable

    from airflow_idempotency.planning import timetable_runs

    tz = _zone(timezone)
    start = start or pendulum.datetime(2026, 1, 5, tz=tz)
    fired = timetable_runs(
        CronTriggerTimetable(expression, timezone=tz), start, start.add(days=span)
    )
    return [r.logical_date.in_timezone(tz).date() for r in fired[:runs]]


def _twice_on_its_first_day(expression: str, timezone: Any) -> bool:
    """Whether the cron ``expression`` fires twice on the first day it fires within four
    years of 2026-01-05: a cron firing twice a day only in some months (``0 8,20 * 3-5 *``,
    ``0 6,18 29 2 *``) has no fire in the days :func:`_fire_days` samples."""
    import pendulum
    from airflow.timetables.base import TimeRestriction
    from airflow.timetables.trigger import CronTriggerTimetable

    tz = _zone(timezone)
    start = pendulum.datetime(2026, 1, 5, tz=tz)
    restriction = TimeRestriction(earliest=start, latest=start.add(days=1500), catchup=True)
    first = CronTriggerTimetable(expression, timezone=tz).next_dagrun_info(
        last_automated_data_interval=None, restriction=restriction
    )
    if first is None or first.logical_date is None:
        return False
    day = first.logical_date.in_timezone(tz).start_of("day")
    days = _fire_days(expression, tz, runs=2, span=1, start=day)
    return len(set(days)) < len(days)


def _zone(timezone: Any) -> Any:
    import pendulum

    return pendulum.timezone(str(getattr(timezone, "name", None) or timezone or "UTC"))


@functools.cache
def _contract_class(cls: type) -> type:
    """``cls`` with its ``execute`` and ``resume_execution`` under the contract: a subclass of
    the same name and module. ``execute`` is set after the class is made, so that Airflow's
    metaclass does not wrap it in a second ExecutorSafeguard (2.x: the original gets the
    sentinel it passes)."""
    sub = type(cls)(
        cls.__name__,
        (cls,),
        {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_idempotency_policy": True,
        },
    )

    original = cls.execute  # type: ignore[attr-defined]
    original_resume = cls.resume_execution  # type: ignore[attr-defined]

    def execute(self: Any, context: Any, **kwargs: Any) -> Any:
        return run_under_policy(self, context, lambda: original(self, context, **kwargs))

    def resume_execution(
        self: Any, next_method: str, next_kwargs: dict[str, Any] | None, context: Any
    ) -> Any:
        """A deferred task resumed by Airflow: a new attempt of its key, ``next_method`` (a
        trigger's failure too: ``__fail__`` raises) its work. Resumed into ``execute``
        itself: the original one, under this attempt (not a second contract inside it)."""
        if next_method == "execute":
            resume = functools.partial(original, self, context, **(next_kwargs or {}))
        else:
            resume = functools.partial(original_resume, self, next_method, next_kwargs, context)
        return run_under_policy(self, context, resume, resumed=next_method)

    sub.execute = execute  # type: ignore[attr-defined]
    sub.resume_execution = resume_execution  # type: ignore[attr-defined]
    return sub


def run_under_policy(task: Any, context: Any, original: Any, resumed: str | None = None) -> Any:
    """Run ``original`` (the task's own execute, or its resumption in the method ``resumed``
    after a deferral) under the contract for ``task``."""
    from airflow_idempotency import airflow_task
    from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS
    from airflow_idempotency.exceptions import IdempotencyError, RunLockedError
    from airflow_idempotency.run_steps import WorkDeferred
    from airflow_idempotency.runner import RunOutcome

    # 2.x reschedules only tasks made for it (sensors): a locked key fails the try there,
    # and Airflow's retries try again.
    wait = airflow_task.LockWait("reschedule" if AIRFLOW_V_3_0_PLUS else "fail")
    task.last_run_outcome = None  # read by notify_once callbacks (this process)
    returned: list[Any] = []
    try:
        result = _run_task(task, context, functools.partial(_work, task, original, returned))
    except WorkDeferred as deferred:
        task.last_run_outcome = "deferred"
        raise deferred.deferral from None  # Airflow's TaskDeferred, unchanged
    except RunLockedError as exc:
        if resumed is None:
            raise airflow_task.airflow_failure(context, exc, wait, task.log) from exc
        raise airflow_task.resumed_lock_failure(exc, resumed) from exc
    except IdempotencyError as exc:
        raise airflow_task.airflow_failure(context, exc, wait, task.log) from exc
    if result.outcome is RunOutcome.COMPLETED:
        return returned[0] if returned else None
    return (result.counts or {}).get("return_value")  # a no-op: what the first run returned


def _run_task(task: Any, context: Any, work: Any) -> Any:
    """The contract for ``task``'s execution of ``context``, ``work`` its work."""
    from airflow_idempotency import airflow_task
    from airflow_idempotency.compat import airflow_run
    from airflow_idempotency.connection import JobDatabase
    from airflow_idempotency.run_key import RunKeyRule
    from airflow_idempotency.runner import RunOutcome
    from airflow_idempotency.schema import DEFAULT_CONN_ID, DEFAULT_SCHEMA

    conn_id = _setting("policy_conn_id", DEFAULT_CONN_ID)
    options = airflow_task.run_options(context)
    # A dry run notifies nothing, even when it fails before its work (as the operator).
    task.last_run_outcome = RunOutcome.DRY_RUN.value if options.dry_run else None
    _check_not_mapped(task, context)
    run = airflow_run(context)
    mapping = airflow_task.KeyMapping(RunKeyRule())
    resolved = airflow_task.context_run_key(mapping, task.dag, context, run)
    task_run = airflow_task.TaskRun(
        job_name=f"{task.dag_id}.{task.task_id}",
        resolved=resolved,
        options=options,
        trigger=airflow_task.trigger(context, run, resolved.zone),
        schema=_setting("policy_schema", DEFAULT_SCHEMA),
        logger=task.log,
    )
    database = JobDatabase(conn_id)
    airflow_task.check_connection(database, conn_id, "set [idempotency] policy_conn_id")
    return airflow_task.run_task(database, task_run, work, context, task)


def _check_not_mapped(task: Any, context: Any) -> None:
    """Refuse an instance of a mapped task group's task: the policy keys a task by its day
    alone, so its instances would share one key and all but the first would be no-ops."""
    from airflow_idempotency import airflow_task
    from airflow_idempotency.exceptions import InvalidInputError

    index = airflow_task.map_index(context)
    if index is not None:
        raise InvalidInputError(
            f"task {task.task_id!r} of DAG {task.dag_id!r} (map index {index}) is mapped (a "
            "mapped task group), and the policy gives all its instances one run key: the "
            "first would do its work and every other would be a no-op. Leave it out of the "
            f'policy (params={{"{EXEMPT_PARAM}": True}}), or use IdempotentRunOperator '
            "with a key_segment per instance"
        )


def _work(task: Any, original: Any, returned: list[Any], ctx: Any) -> dict[str, Any]:
    """The task's own execute as the contract's work; its return value kept when small."""
    if ctx.dry_run:
        task.log.info("dry run: %s is not executed (the policy cannot roll it back)", task)
        return {}
    from airflow_idempotency.compat import TaskDeferred
    from airflow_idempotency.run_steps import WorkDeferred

    with _run_environment({RUN_KEY_ENV: ctx.run_key, JOB_ENV: ctx.job_name}):
        try:
            value = original()
        except TaskDeferred as exc:  # the attempt ends deferred, the key stays started
            raise WorkDeferred(exc) from exc
    returned.append(value)
    return {"return_value": value} if _replayable(value) else {}


def _replayable(value: Any) -> bool:
    """Whether ``value`` can be kept with the run: JSON that PostgreSQL's jsonb takes (no NaN
    or Infinity, no NUL character: json.dumps writes them, and the completion write would
    fail after the work) of at most :data:`MAX_REPLAYED_BYTES`."""
    if value is None:
        return False
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return len(text) <= MAX_REPLAYED_BYTES and "\\u0000" not in text


@contextlib.contextmanager
def _run_environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment (inherited by the subprocesses the task
    starts, dbt's among them) for the duration; what was there before is put back (``dag.test``
    runs every task in one process)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


__all__ = [
    "EXEMPT_PARAM",
    "JOB_ENV",
    "RUN_KEY_ENV",
    "covered",
    "dag_policy",
    "exempt",
    "key_refusal",
    "policy_tags",
    "protected",
]
