"""``IdempotentRunOperator``: Airflow's run -> run key -> the idempotent-run contract."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from airflow_idempotency import airflow_task
from airflow_idempotency.airflow_task import OnLocked
from airflow_idempotency.airflow_task import conf_flag as conf_flag
from airflow_idempotency.arguments import (
    check_arguments,
    check_mapped_arguments,
    check_work_function,
)
from airflow_idempotency.compat import (
    AirflowRun,
    AirflowSkipException,
    Context,
    Param,
    ReschedulingOperator,
    add_partition_event,
    airflow_run,
)
from airflow_idempotency.exceptions import IdempotencyError, InvalidInputError, RunLockedError
from airflow_idempotency.links import LINK_TARGET_ATTRIBUTE, run_key_links
from airflow_idempotency.partitions import SEGMENT_DELIMITER
from airflow_idempotency.records import RunOptions
from airflow_idempotency.run_context import RunContext
from airflow_idempotency.run_key import ResolvedRunKey, RunKeyRule, check_text
from airflow_idempotency.run_steps import WorkDeferred
from airflow_idempotency.runner import RunOutcome, RunResult
from airflow_idempotency.schema import DEFAULT_CONN_ID, DEFAULT_SCHEMA

if TYPE_CHECKING:
    from airflow_idempotency.connection import JobDatabase
    from airflow_idempotency.hook import IdempotencyHook

OnCompleted = Literal["succeed", "skip"]


def idempotency_params(period: str = "day", *, segments: bool = False) -> dict[str, Param]:
    """Trigger-form fields for a DAG of idempotent runs: ``run_key``, ``force``, ``dry_run``.

    Use as ``DAG(..., params=idempotency_params())``. The run_key field is a date picker
    for daily jobs; left empty, the run key comes from the partition key or the logical
    date. ``segments=True``: a text field, for keys with segments (``eu|2026-10-01``).
    """
    hint = RunKeyRule(period=period).format_hint  # type: ignore[arg-type]
    if segments:
        hint = f"{hint}, after its labels if it has segments (e.g. eu|2026-10-01)"
    date_format: dict[str, Any] = {"format": "date"} if period == "day" and not segments else {}
    run_key = Param(
        None,
        type=["null", "string"],
        title="Run key (business date)",
        description=(
            f"The business period to process, {hint}. Set it when rerunning a date by hand: "
            "the logical date the form pre-fills is the current time, not the date you mean."
        ),
        **date_format,
    )
    return {
        "run_key": run_key,
        "force": Param(
            False, type="boolean", title="Force", description="Recompute a completed run key."
        ),
        "dry_run": Param(
            False,
            type="boolean",
            title="Dry run",
            description="Run the work in a transaction that is rolled back; no external calls.",
        ),
    }


def _return_value(result: RunResult) -> dict[str, Any] | None:
    """The task's XCom: the work's counts (replayed on a no-op); none when empty or dry."""
    if result.outcome is RunOutcome.DRY_RUN or not result.counts:
        return None
    return dict(result.counts)


class IdempotentRunOperator(ReschedulingOperator):
    """Run ``python_callable`` (or :meth:`run`) at most once to completion per run key.

    The run key names the business period (see :mod:`airflow_idempotency.run_key`); a
    Postgres advisory lock keeps two executions of one key apart; ``job_runs`` and
    ``job_run_attempts`` record what every execution did.

    The task's return value (its ``return_value`` XCom, what a TaskFlow downstream task
    receives) is the dict of counts ``python_callable`` returned, or, on a no-op, the one
    stored when the key completed, so that a rerun passes on what the first run did. A work
    that returns nothing (or an empty dict), and a dry run, push no XCom, like a plain
    ``@task`` returning ``None``. What the task did (completed, no-op, dry run) is in its
    log, its attempt row and the Run keys view.

    :param python_callable: called with one argument, the :class:`RunContext` (plus
        ``op_args``/``op_kwargs``); may return a dict of counts, stored in job_runs.details.
    :param postgres_conn_id: Airflow connection of the database holding the run records.
    :param job_name: name of the job in the run records (templated); default
        ``<dag_id>.<task_id>``. Give two DAGs the same job name to make them exclude each other.
    :param run_key_rule: a :class:`RunKeyRule`, or a callable taking the Airflow context and
        returning the run key (used for runs without an explicit run_key).
    :param on_locked: when another execution holds the key: ``reschedule`` (default; the
        task waits ``reschedule_interval`` and tries again without using a retry),
        ``fail`` (no retry) or ``skip``.
    :param reschedule_interval: wait between tries while the key is locked. Not below 10 s
        or so: a shorter one races Airflow's scheduler (docs/deploying.md, apache/airflow#71172).
    :param lock_timeout: give up (fail, retries apply) after rescheduling this long.
    :param on_completed: for an already completed key: ``succeed`` (a no-op) or ``skip``.
    :param schema: Postgres schema of the bookkeeping tables.
    :param key_segment: this task's own segment of the work (templated, and what a mapped
        task expands over: ``.partial(...).expand(key_segment=["eu", "us"])``): the run key
        becomes ``<segment>|<key>``, each segment locked and recorded apart.
    :param emit_on_noop: a no-op (an already completed key) or a dry run emits the task's
        ``outlets`` asset events too. Default ``False``: only a run that did the work emits
        them, so a consumer never runs again for work that was already done.
    :param op_args: positional arguments passed to ``python_callable`` after the context.
    :param op_kwargs: keyword arguments passed to ``python_callable`` (templated).
    """

    template_fields: Sequence[str] = ("job_name", "key_segment", "op_kwargs")
    ui_color = "#e8f4e8"
    _check_callable = True  # that python_callable(run, *op_args, **op_kwargs) binds
    operator_extra_links = run_key_links()

    def __init__(
        self,
        *,
        python_callable: Callable[..., Mapping[str, Any] | None] | None = None,
        postgres_conn_id: str = DEFAULT_CONN_ID,
        job_name: str | None = None,
        run_key_rule: RunKeyRule | Callable[[Context], str] | None = None,
        on_locked: OnLocked = "reschedule",
        reschedule_interval: dt.timedelta = dt.timedelta(seconds=30),
        lock_timeout: dt.timedelta = dt.timedelta(hours=6),
        on_completed: OnCompleted = "succeed",
        schema: str = DEFAULT_SCHEMA,
        key_segment: str | None = None,
        emit_on_noop: bool = False,
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # Checked here, where the DAG file is parsed: a mistake is the file's import error in
        # Airflow's UI, not a task failing at 01:00 (templated values are checked at run time).
        in_dag = self.has_dag()  # type: ignore[no-untyped-call]
        where = f"task {self.task_id!r}" + (f" of DAG {self.dag_id!r}" if in_dag else "")
        self._check_work(where, python_callable, list(op_args or []), dict(op_kwargs or {}))
        check_arguments(
            where,
            {
                "job_name": job_name,
                "postgres_conn_id": postgres_conn_id,
                "run_key_rule": run_key_rule,
                "on_locked": on_locked,
                "on_completed": on_completed,
                "reschedule_interval": reschedule_interval,
                "lock_timeout": lock_timeout,
                "schema": schema,
                "key_segment": key_segment,
                "emit_on_noop": emit_on_noop,
            },
            default_job_name=f"{self.dag_id}.{self.task_id}" if in_dag else None,
        )
        self.python_callable = python_callable
        self.postgres_conn_id = postgres_conn_id
        self.job_name = job_name
        self.run_key_rule = run_key_rule if run_key_rule is not None else RunKeyRule()
        self.on_locked = on_locked
        self.reschedule_interval = reschedule_interval
        self.lock_timeout = lock_timeout
        self.on_completed = on_completed
        self.schema = schema
        self.key_segment = key_segment
        self.emit_on_noop = emit_on_noop
        self.op_args = list(op_args or [])
        self.op_kwargs = dict(op_kwargs or {})

    def _check_work(
        self,
        where: str,
        python_callable: Callable[..., Any] | None,
        op_args: list[Any],
        op_kwargs: dict[str, Any],
    ) -> None:
        """The work: a function that takes the RunContext first, or a subclass's run()."""
        if python_callable is None and type(self).run is IdempotentRunOperator.run:
            raise InvalidInputError(
                f"task {self.task_id!r}: pass python_callable or override run() in a subclass"
            )
        if python_callable is not None and not callable(python_callable):
            raise InvalidInputError(f"task {self.task_id!r}: python_callable must be callable")
        if python_callable is not None and self._check_callable:
            try:
                check_work_function(python_callable, op_args, op_kwargs)
            except InvalidInputError as exc:
                raise InvalidInputError(f"{where}: {exc}") from None

    @classmethod
    def partial(cls, **kwargs: Any) -> Any:
        """The mapped form, ``.partial(...).expand(...)``, with the arguments given here
        checked where the DAG file is parsed, as the constructor checks them (it runs only
        when each mapped task is made, at run time)."""
        partial = super().partial(**kwargs)
        dag = partial.kwargs.get("dag")
        try:
            check_mapped_arguments(partial.kwargs["task_id"], getattr(dag, "dag_id", None), kwargs)
        except InvalidInputError:
            partial._expand_called = True  # no "never expanded" warning on top of the error
            raise
        return partial

    @cached_property
    def hook(self) -> IdempotencyHook:
        """The hook of ``postgres_conn_id``, for a subclass's own use (created on first use;
        the Postgres provider's hook is imported then). The contract's own connections come
        from :attr:`job_database`, which needs none of the hook's imports."""
        from airflow_idempotency.hook import IdempotencyHook

        return IdempotencyHook(postgres_conn_id=self.postgres_conn_id)

    @cached_property
    def job_database(self) -> JobDatabase:
        """The job database of ``postgres_conn_id`` (looked up on first use, never at
        parse time)."""
        from airflow_idempotency.connection import JobDatabase

        return JobDatabase(self.postgres_conn_id)

    def run(self, ctx: RunContext) -> Mapping[str, Any] | None:
        """The work of one run key. Override in a subclass, or pass ``python_callable``."""
        assert self.python_callable is not None
        return self.python_callable(ctx, *self.op_args, **self.op_kwargs)

    # -- mapping Airflow's run to the contract ---------------------------------------------

    def resolve_run_key(self, context: Context, run: AirflowRun | None = None) -> ResolvedRunKey:
        """The run key of this task execution (decided by :func:`resolve_run_key`);
        ``run``: what was read of it from ``context`` already."""
        return airflow_task.context_run_key(self._key_mapping, self._dag_or_none(), context, run)

    def explain_run_key(
        self,
        *,
        kind: str,
        logical_date: dt.datetime | None,
        conf: Mapping[str, Any],
        partition_key: str | None = None,
        timetable_name: str | None = None,
        partition_date: dt.datetime | None = None,
    ) -> ResolvedRunKey:
        """The run key a run of ``kind`` (manual, scheduled, backfill) at ``logical_date``
        (or for ``partition_key``, whose exact instant is ``partition_date`` when known) with
        ``conf`` would get, or the error it would get (``airflow-idempotency explain``,
        ``plan``).

        The DAG's params are merged with ``conf`` as Airflow does. A callable rule is called
        with a context of those facts only (logical_date, partition_key, params, dag, dag_run).
        """
        return airflow_task.explained_run_key(
            self._key_mapping,
            self._dag_or_none(),
            kind=kind,
            logical_date=logical_date,
            conf=conf,
            partition=(partition_key, partition_date),
            timetable_name=timetable_name,
        )

    @property
    def _key_mapping(self) -> airflow_task.KeyMapping:
        return airflow_task.KeyMapping(self.run_key_rule, self.key_segment)

    @property
    def effective_job_name(self) -> str:
        """The job's name in the run records: ``job_name``, else ``<dag_id>.<task_id>``."""
        return self.job_name if self.job_name is not None else f"{self.dag_id}.{self.task_id}"

    def run_options(self, context: Context) -> RunOptions:
        """``force`` and ``dry_run`` of this run, from its conf or params (booleans)."""
        return airflow_task.run_options(context)

    def _dag_or_none(self) -> Any:
        return airflow_task.dag_of(self)

    def execute(self, context: Context) -> dict[str, Any] | None:
        return self._under_contract(context, self.run)

    def resume_execution(
        self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context
    ) -> Any:
        """A deferred task resumed by Airflow (its ``run`` deferred: ``self.defer(...)``): a
        new attempt of its key whose work is the method ``next_method`` (it returns the
        counts, as ``run`` does; ``__fail__``, a trigger's failure, raises), a no-op once the
        key is completed. Resumed into ``execute`` itself: ``run`` again."""
        if next_method == "execute":
            return self._under_contract(context, self.run, next_method)
        resume = super().resume_execution
        return self._under_contract(
            context, lambda ctx: resume(next_method, next_kwargs, context), next_method
        )

    def _under_contract(
        self, context: Context, work: Callable[[RunContext], Any], resumed: str | None = None
    ) -> dict[str, Any] | None:
        """``work`` under the contract; a deferral (``TaskDeferred``) ends the attempt
        ``deferred`` and goes to Airflow unchanged (docs/policy.md, deferrable operators)."""
        try:
            return self._execute(context, airflow_task.deferrable(work))
        except WorkDeferred as deferred:
            self.last_run_outcome: str | None = "deferred"  # notify_once reads it
            raise deferred.deferral from None
        except RunLockedError as exc:
            if resumed is None:
                raise self.airflow_failure(context, exc) from exc
            raise airflow_task.resumed_lock_failure(exc, resumed) from exc
        except IdempotencyError as exc:
            raise self.airflow_failure(context, exc) from exc

    def _execute(
        self, context: Context, work: Callable[[RunContext], Any]
    ) -> dict[str, Any] | None:
        self.last_run_outcome = None  # read by notify_once callbacks (this process)
        options = self.run_options(context)
        # A dry run notifies nothing, even when it fails, also before its work starts (a key
        # refused, the database down): notify_once reads this.
        self.last_run_outcome = RunOutcome.DRY_RUN.value if options.dry_run else None
        job_name = check_text(self.effective_job_name, "job name")
        airflow_task.check_mapped_segment(self._key_mapping, self, context)
        run = airflow_run(context)
        resolved = self.resolve_run_key(context, run)
        # The "Run key" extra link (computed by the worker when the task ends) names this key.
        setattr(self, LINK_TARGET_ATTRIBUTE, (job_name, resolved.run_key))
        self._check_connection()
        task_run = airflow_task.TaskRun(
            job_name,
            resolved,
            options,
            airflow_task.trigger(context, run, resolved.zone),
            self.schema,
            self.log,
        )
        result = airflow_task.run_task(self.job_database, task_run, work, context, self)
        if result.outcome is RunOutcome.NOOP and self.on_completed == "skip":
            raise AirflowSkipException(
                f"job={job_name} run_key={resolved.run_key}: already completed, skipping"
            )
        self._asset_events(context, result.outcome, resolved.run_key, run.partition_key)
        return _return_value(result)

    def _asset_events(
        self, context: Context, outcome: RunOutcome, run_key: str, partition_key: str | None
    ) -> None:
        """What the success tells Airflow about the task's ``outlets``.

        The Task SDK (3.3.2, ``_handle_current_task_success``) sends the task's ``outlets``
        as they are when ``execute`` returns, and the api-server emits one asset event per
        outlet: emptied here, a no-op or a dry run emits none (the work's event went out
        when the key completed). A mapped segment's event names its segment before the
        run's partition key (``eu|2026-10-01T01:00:00``), so a consumer with a
        ProductMapper runs per segment.
        """
        if not self.outlets:
            return
        if outcome is not RunOutcome.COMPLETED and not self.emit_on_noop:
            self.log.info(
                "run_key=%s: %s, so no asset event for %d outlet(s) (emit_on_noop=False)",
                run_key,
                outcome.value,
                len(self.outlets),
            )
            self.outlets = []
            return
        if self.key_segment is not None and partition_key is not None:
            add_partition_event(
                context, self.outlets, f"{self.key_segment}{SEGMENT_DELIMITER}{partition_key}"
            )

    def airflow_failure(self, context: Context, exc: IdempotencyError) -> BaseException:
        """The Airflow exception that ends this try for ``exc``
        (:func:`airflow_task.airflow_failure`, with this task's ``on_locked`` policy)."""
        wait = airflow_task.LockWait(self.on_locked, self.reschedule_interval, self.lock_timeout)
        return airflow_task.airflow_failure(context, exc, wait, self.log)

    def _check_connection(self) -> None:
        airflow_task.check_connection(
            self.job_database, self.postgres_conn_id, "pass postgres_conn_id= to the operator"
        )
