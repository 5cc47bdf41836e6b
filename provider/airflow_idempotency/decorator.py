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
from typing import Any

from airflow_idempotency.compat import DecoratedOperator, TaskDecorator, task_decorator_factory
from airflow_idempotency.operator import IdempotentRunOperator


class _IdempotentDecoratedOperator(DecoratedOperator, IdempotentRunOperator):  # type: ignore[misc]
    custom_operator_name: str = "@task.idempotent_run"
    template_fields: Sequence[str] = ("job_name", "key_segment", "op_args", "op_kwargs")

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
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=_IdempotentDecoratedOperator,
        **kwargs,
    )
