"""An Airflow task execution mapped to the contract, for the operator and the policy.

Its run key, its switches, its trigger, the call of
:func:`~airflow_idempotency.runner.run_idempotently`, and the Airflow exception that ends a
refused try.

Shared by :class:`~airflow_idempotency.operator.IdempotentRunOperator` (whose own work is
the contract's work) and the cluster policy (:mod:`airflow_idempotency.policy`, which puts
any task of a tagged DAG under the contract), so that both key a run by the same rules.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pendulum
import psycopg

from airflow_idempotency._sql import query_row
from airflow_idempotency.arguments import unsegmented_mapped_task
from airflow_idempotency.compat import (
    AIRFLOW_NOT_FOUND,
    AirflowException,
    AirflowFailException,
    AirflowRescheduleException,
    AirflowRun,
    Context,
    airflow_run,
    reschedule_count,
)
from airflow_idempotency.exceptions import (
    ConfigurationError,
    EffectsUnknownError,
    IdempotencyError,
    InvalidInputError,
    RunLockedError,
    TransactionMisuseError,
)
from airflow_idempotency.locks import ON_LOCKED_ENV
from airflow_idempotency.metrics import AIRFLOW_METRICS
from airflow_idempotency.partitions import dag_partitioning
from airflow_idempotency.provenance import read_provenance
from airflow_idempotency.records import RunOptions, Trigger
from airflow_idempotency.run_context import RunEnvironment, autocommit_connection
from airflow_idempotency.run_key import (
    OVERRIDE_FLAG,
    ResolvedRunKey,
    RunFacts,
    RunKeyCallable,
    RunKeyRule,
    resolve_run_key,
)
from airflow_idempotency.run_steps import WorkDeferred
from airflow_idempotency.runner import RunOutcome, RunResult, Work, run_idempotently

if TYPE_CHECKING:
    from airflow_idempotency.connection import JobDatabase

OnLocked = Literal["reschedule", "fail", "skip"]


def conf_flag(context: Context, name: str) -> bool:
    """A boolean switch of the run: its conf wins over its params; anything else is refused."""
    return flag(context["dag_run"].conf or {}, context.get("params") or {}, name)


def flag(conf: Mapping[str, Any], params: Mapping[str, Any], name: str) -> bool:
    """:func:`conf_flag` on the run's conf and params as given."""
    value = conf.get(name, params.get(name, False))
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidInputError(f"{name} must be true or false, got {value!r} in the run's conf/params")


def run_options(context: Context) -> RunOptions:
    """``force`` and ``dry_run`` of this run, from its conf or params (booleans)."""
    return RunOptions(force=conf_flag(context, "force"), dry_run=conf_flag(context, "dry_run"))


@dataclass(frozen=True)
class KeyMapping:
    """How one task's runs map to run keys: its rule and its own segment of the work."""

    rule: RunKeyRule | RunKeyCallable
    key_segment: str | None = None


def dag_of(task: Any) -> Any:
    """The task's DAG, or ``None`` for a task outside one."""
    return task.dag if task.has_dag() else None


def timezone_name(dag: Any) -> str:
    tz = dag.timezone if dag else None
    return str(getattr(tz, "name", None) or tz or "UTC")


@dataclass(frozen=True)
class RunSeen:
    """What the run key is decided from: the run's kind, dates, conf and params."""

    kind: str
    logical_date: dt.datetime | None
    conf: Mapping[str, Any]
    params: Mapping[str, Any]
    context: Any
    partition: tuple[str | None, dt.datetime | None] = (None, None)
    timetable_name: str | None = None


def resolve(mapping: KeyMapping, dag: Any, seen: RunSeen) -> ResolvedRunKey:
    """The run key of a run ``seen`` of a task of ``dag`` (:func:`resolve_run_key`)."""
    partitioned, spec = dag_partitioning(dag)
    facts = RunFacts(
        run_type=seen.kind,
        timezone=timezone_name(dag),
        now=pendulum.now("UTC"),
        timetable_name=seen.timetable_name or (type(dag.timetable).__name__ if dag else None),
        logical_date=seen.logical_date,
        partition_key=seen.partition[0],
        partition_date=seen.partition[1],
        partitioned=partitioned,
        partition_spec=spec,
        conf_run_key=seen.conf.get("run_key"),
        params_run_key=seen.params.get("run_key"),
        override_partition=flag(seen.conf, seen.params, OVERRIDE_FLAG),
        key_segment=mapping.key_segment,
        context=seen.context,
    )
    return resolve_run_key(mapping.rule, facts)


def context_run_key(
    mapping: KeyMapping, dag: Any, context: Context, run: AirflowRun | None = None
) -> ResolvedRunKey:
    """The run key of the task execution of ``context``."""
    run = run or airflow_run(context)
    seen = RunSeen(
        kind=run.run_type,
        logical_date=run.logical_date,
        conf=context["dag_run"].conf or {},
        params=context.get("params") or {},
        context=context,
        partition=(run.partition_key, run.partition_date),
    )
    return resolve(mapping, dag, seen)


def explained_run_key(
    mapping: KeyMapping,
    dag: Any,
    *,
    kind: str,
    logical_date: dt.datetime | None,
    conf: Mapping[str, Any],
    partition: tuple[str | None, dt.datetime | None] = (None, None),
    timetable_name: str | None = None,
) -> ResolvedRunKey:
    """The run key a run of ``kind`` at ``logical_date`` (or for the partition
    ``(partition_key, partition_date)``: its key, and its exact instant when known) with
    ``conf`` would get: the DAG's params merged with ``conf`` as Airflow does; a callable
    rule gets a context of those facts only."""
    partition_key, partition_date = partition
    params = {**(dag.params.dump() if dag else {}), **conf}
    run = types.SimpleNamespace(
        conf=dict(conf),
        run_type=kind,
        logical_date=logical_date,
        run_after=logical_date,
        partition_key=partition_key,
        partition_date=partition_date,
    )
    context = {
        "logical_date": logical_date,
        "partition_key": partition_key,
        "partition_date": partition_date,
        "params": params,
        "dag": dag,
        "dag_run": run,
    }
    seen = RunSeen(kind, logical_date, conf, params, context, partition, timetable_name)
    return resolve(mapping, dag, seen)


def map_index(context: Context) -> int | None:
    """The index of this execution when its task is mapped, else ``None`` (a context
    without a ti, as the fuzz tests build, is not mapped)."""
    index = getattr(context.get("ti"), "map_index", None)
    return index if index is not None and index >= 0 else None


def check_mapped_segment(mapping: KeyMapping, task: Any, context: Context) -> None:
    """Refuse a mapped instance without its own segment of the key, unless a function
    keys it (it may tell the instances apart): its siblings would share its key."""
    index = map_index(context)
    if index is None or mapping.key_segment is not None:
        return
    if isinstance(mapping.rule, RunKeyRule):
        where = f"task {task.task_id!r} of DAG {task.dag_id!r} (map index {index})"
        raise InvalidInputError(unsegmented_mapped_task(where))


def trigger(context: Context, run: AirflowRun, key_zone: str | None) -> Trigger:
    """Who started this execution, the Airflow ids it runs under (with its provenance:
    :mod:`.provenance`), and the zone its key was made in (``ResolvedRunKey.zone``: the key
    zone rule)."""
    ti = context["ti"]
    return Trigger(
        triggered_by=run.triggered_by,
        triggering_user=run.triggering_user,
        dag_id=ti.dag_id,
        run_id=ti.run_id,
        task_id=ti.task_id,
        try_number=ti.try_number,
        map_index=ti.map_index if ti.map_index is not None and ti.map_index >= 0 else None,
        partition_key=run.partition_key,
        key_zone=key_zone,
        provenance=read_provenance(context, run.run_type),
    )


def check_connection(job_database: JobDatabase, conn_id: str, where: str) -> None:
    """Fail the task (no retry) when the Airflow connection ``conn_id`` is not defined."""
    try:
        job_database.connection  # noqa: B018 - resolves the id, fails if unknown
    except AIRFLOW_NOT_FOUND as exc:
        raise AirflowFailException(
            f"Airflow connection {conn_id!r} is not defined. Create it (for example "
            f"AIRFLOW_CONN_{conn_id.upper()}='postgresql://user:pass@host:5432/db') "
            f"or {where}."
        ) from exc


@dataclass(frozen=True)
class TaskRun:
    """One task execution under the contract: what :func:`run_task` needs."""

    job_name: str
    resolved: ResolvedRunKey
    options: RunOptions
    trigger: Trigger
    schema: str
    logger: logging.Logger | Any


def run_task(
    job_database: JobDatabase, task_run: TaskRun, work: Work, context: Context, task: Any
) -> RunResult:
    """Run ``work`` under the contract for ``task_run``, logging the key and its reason;
    ``task.last_run_outcome`` says how it ended (``notify_once`` callbacks read it)."""
    task_run.logger.info(
        "job=%s run_key=%s %s (force=%s, dry_run=%s)",
        task_run.job_name,
        task_run.resolved.run_key,
        task_run.resolved.explanation,
        task_run.options.force,
        task_run.options.dry_run,
    )
    # A dry run notifies nothing, even when it fails.
    task.last_run_outcome = RunOutcome.DRY_RUN.value if task_run.options.dry_run else None
    if task_run.options.force:
        task_run = honour_force_once(job_database, task_run)
    result = run_idempotently(
        connect=job_database.new_connection,
        job_name=task_run.job_name,
        run_key=task_run.resolved.run_key,
        work=work,
        options=task_run.options,
        trigger=task_run.trigger,
        environment=RunEnvironment(
            schema=task_run.schema,
            logger=task_run.logger,
            metrics=AIRFLOW_METRICS,
            airflow_context=context,
        ),
        **job_database.lock_options,
    )
    task.last_run_outcome = result.outcome.value
    return result


def honour_force_once(job_database: JobDatabase, task_run: TaskRun) -> TaskRun:
    """``task_run`` without ``force`` when an earlier try of this very DAG run (the same task,
    map index and clear) already completed the key: its force was honoured, and a retry
    (after a worker lost between the completion and Airflow's success) must not recompute
    it again. A Clear of the run (a new clear number) or a new forced run recomputes.

    Read before the run's lock: dropping ``force`` can only turn the run into the no-op the
    locked decision takes for a completed key."""
    trigger = task_run.trigger
    params = {
        "job_name": task_run.job_name,
        "run_key": task_run.resolved.run_key,
        "dag_id": trigger.dag_id,
        "run_id": trigger.run_id,
        "task_id": trigger.task_id,
        "map_index": trigger.map_index,
        "clear_number": trigger.provenance.clear_number,
        "try_number": trigger.try_number,
    }
    try:
        with autocommit_connection(job_database.new_connection) as conn:
            row = query_row(conn, "completed_by_this_dag_run", task_run.schema, params)
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
        return task_run  # no bookkeeping tables yet (or before migration 11): nothing done
    if row is None:
        return task_run
    task_run.logger.info(
        "force: try %s of this DAG run already recomputed run_key %s (attempt %s); this "
        "try does not recompute it again (Clear the DAG run or trigger a new forced run to "
        "recompute)",
        row["try_number"],
        task_run.resolved.run_key,
        row["attempt_id"],
    )
    options = RunOptions(force=False, dry_run=task_run.options.dry_run)
    return dataclasses.replace(task_run, options=options)


def deferrable(work: Work) -> Work:
    """``work`` whose Airflow deferral (``TaskDeferred``) ends its attempt ``deferred``
    (:class:`~airflow_idempotency.run_steps.WorkDeferred`) instead of failing it."""
    from airflow_idempotency.compat import TaskDeferred

    def deferring(ctx: Any) -> Mapping[str, Any] | None:
        try:
            return work(ctx)
        except TaskDeferred as exc:
            if getattr(ctx, "_rolled_back_by", None) is exc:
                raise TransactionMisuseError(
                    "the task deferred inside run.transaction(): the deferral (TaskDeferred) "
                    "left the block as an exception and rolled its writes back, so resuming "
                    "would complete the key without them. Call self.defer() after the block "
                    "ends; this try fails and the key is failed (rerun once fixed)"
                ) from exc
            raise WorkDeferred(exc) from exc

    return deferring


def resumed_lock_failure(exc: RunLockedError, resumed: str) -> BaseException:
    """The failure of a resumed task (after a deferral, in the method ``resumed``) whose key
    another execution holds: it does not wait (a resumed task cannot be rescheduled back into
    its trigger); a retry starts the task again from ``execute``, under the contract."""
    return AirflowException(
        f"{exc}; the resumed task ({resumed}) does not wait for it: this try fails, and a "
        "retry (or a rerun) starts the task again from execute under the contract (a "
        "no-op once the key is completed)"
    )


@dataclass(frozen=True)
class LockWait:
    """What a try does when another execution holds its key (``on_locked``)."""

    on_locked: OnLocked = "reschedule"
    reschedule_interval: dt.timedelta = dt.timedelta(seconds=30)
    lock_timeout: dt.timedelta = dt.timedelta(hours=6)


def airflow_failure(
    context: Context, exc: IdempotencyError, wait: LockWait, logger: Any
) -> BaseException:
    """The Airflow exception that ends this try for ``exc``: the one place that maps them.

    Bad input and configuration: fail without retrying (a retry would meet the same
    refusal), and so do effects left unknown (only an operator's resolution lets the key go
    on). A locked key: ``wait``. A lost lock or unfinished effects: an ordinary failure, so
    Airflow's retries apply and a retry converges.
    """
    if isinstance(exc, RunLockedError):
        return _on_locked(context, exc, wait, logger)
    if isinstance(exc, InvalidInputError | ConfigurationError | EffectsUnknownError):
        return AirflowFailException(str(exc))
    return AirflowException(str(exc))


def _on_locked(context: Context, exc: RunLockedError, wait: LockWait, logger: Any) -> BaseException:
    from airflow_idempotency.compat import AirflowSkipException

    # The CLI's `run` sets this so that a locked key fails at once (exit code 75).
    policy = os.environ.get(ON_LOCKED_ENV) or wait.on_locked
    if policy not in ("reschedule", "fail", "skip"):
        return AirflowFailException(f"{ON_LOCKED_ENV}={policy!r}: use reschedule, fail or skip")
    if policy == "skip":
        return AirflowSkipException(f"{exc}; skipping (on_locked='skip')")
    if policy == "fail":
        return AirflowFailException(f"{exc}; failing (on_locked='fail')")
    waited = wait.reschedule_interval * reschedule_count(context)
    if waited >= wait.lock_timeout:
        return AirflowException(
            f"{exc}; still locked after about {waited} of rescheduling "
            f"(lock_timeout={wait.lock_timeout}): giving up this try"
        )
    when = pendulum.now("UTC") + wait.reschedule_interval
    logger.info("lock held elsewhere: rescheduling to %s (waited ~%s so far)", when, waited)
    return AirflowRescheduleException(when)  # type: ignore[no-untyped-call]
