"""``@task.idempotent_run``: the TaskFlow form of :class:`IdempotentRunOperator`.

The decorated function takes the :class:`~airflow_idempotency.run_context.RunContext` as its
first argument; any further arguments are passed in the DAG as with ``@task``::

    @task.idempotent_run(postgres_conn_id="jobs_db")
    def load(run: RunContext) -> dict[str, int]:
        ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

from airflow_idempotency.arguments import check_mapped_arguments, check_work_function
from airflow_idempotency.compat import DecoratedOperator, TaskDecorator, task_decorator_factory
from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.operator import IdempotentRunOperator


class _IdempotentDecoratedOperator(DecoratedOperator, IdempotentRunOperator):  # type: ignore[misc]
    custom_operator_name: str = "@task.idempotent_run"
    template_fields: Sequence[str] = ("job_name", "key_segment", "op_args", "op_kwargs")
    _check_callable = False  # checked here, before DecoratedOperator binds it to None

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Any = None,
        op_kwargs: Any = None,
        **kwargs: Any,
    ) -> None:
        # DecoratedOperator checks the call's arguments against the function's signature;
        # the first parameter is the RunContext the operator supplies at run time, so the
        # check sees the function with that parameter already bound.
        try:
            check_work_function(python_callable, list(op_args or []), dict(op_kwargs or {}))
        except InvalidInputError as exc:
            raise InvalidInputError(f"task {kwargs.get('task_id')!r}: {exc}") from None
        kwargs_to_upstream = {
            "python_callable": python_callable,
            "op_args": op_args,
            "op_kwargs": op_kwargs,
        }
        super().__init__(
            python_callable=functools.partial(python_callable, None),
            op_args=op_args,
            op_kwargs=op_kwargs,
            kwargs_to_upstream=kwargs_to_upstream,
            **kwargs,
        )
        self.python_callable = python_callable


def idempotent_run_task(
    python_callable: Callable[..., Any] | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """Wrap a function into an :class:`IdempotentRunOperator` (``@task.idempotent_run``).

    Accepts every argument of :class:`IdempotentRunOperator` (``postgres_conn_id``,
    ``job_name``, ``run_key_rule``, ``on_locked``, ...).
    """
    decorator = task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=_IdempotentDecoratedOperator,
        **kwargs,
    )
    if python_callable is not None:
        return _checked_when_expanded(decorator)
    factory: Any = decorator
    return cast(TaskDecorator, lambda function: _checked_when_expanded(factory(function)))


def _checked_when_expanded(decorator: Any) -> TaskDecorator:
    """``decorator`` (Airflow's task decorator of one function) whose ``.expand()`` checks
    the arguments given to ``@task.idempotent_run`` (and ``.override()``) where the DAG file
    is parsed: a mapped task's constructor, which checks them otherwise, runs only at run
    time."""
    decorator.__class__ = _expand_checking(decorator.__class__)
    return cast(TaskDecorator, decorator)


@functools.cache
def _expand_checking(base: Any) -> type:
    """A subclass of Airflow's task decorator class ``base`` (its module differs between
    the lines) whose ``_expand``, behind ``.expand()`` and ``.expand_kwargs()``, checks the
    mapped task's arguments (:func:`~airflow_idempotency.arguments.check_mapped_arguments`)."""

    def _expand(self: Any, expand_input: Any, *, strict: bool) -> Any:
        mapped = base._expand(self, expand_input, strict=strict)
        task = mapped.operator
        dag_id = getattr(task.dag, "dag_id", None)
        check_mapped_arguments(task.task_id, dag_id, self.kwargs, expanded=True)
        return mapped

    return type(base.__name__, (base,), {"_expand": _expand, "__module__": __name__})
