"""The operator's arguments, checked where the DAG file is parsed.

:class:`~airflow_idempotency.operator.IdempotentRunOperator` (and so ``@task.idempotent_run``)
calls :func:`check_arguments` in its constructor: a DAG file that gives an empty or overlong
job name, an unknown policy, a wrong period or a negative wait fails to import, and Airflow's
DAG processor shows the message as the file's import error, instead of the task failing at
01:00. A value that Jinja renders at run time (``job_name="{{ params.job }}"``) is checked
then, by the runner, like every other value.

No Airflow import here: the checks are plain functions of plain values.
"""

from __future__ import annotations

import datetime as dt
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.key_spelling import check_label
from airflow_idempotency.partitions import SEGMENT_DELIMITER
from airflow_idempotency.run_key import MAX_KEY_LENGTH, RunKeyRule, check_text
from airflow_idempotency.schema import validate_schema_name

ON_LOCKED = ("reschedule", "fail", "skip")
ON_COMPLETED = ("succeed", "skip")


def is_templated(value: str) -> bool:
    """Whether Airflow renders ``value`` with Jinja before the task runs (it holds ``{{``,
    ``{%`` or ``{#``): its final text is known only then."""
    return any(marker in value for marker in ("{{", "{%", "{#"))


def check_job_name(value: object, *, default: str | None = None) -> str | None:
    """A job name as given to the operator (``None``: the default name), or raise.

    ``default`` is the name the operator would use instead (``<dag_id>.<task_id>``), when the
    DAG is known: it must fit the run records too. A templated name is only checked for
    being text here.
    """
    if value is None:
        if default is not None:
            _check(default, f"the default job name <dag_id>.<task_id> {default!r}", _shorter)
        return None
    if not isinstance(value, str):
        raise InvalidInputError(
            f"job_name must be text (or None for <dag_id>.<task_id>), got "
            f"{type(value).__name__}: {value!r}"
        )
    if value == "":
        raise InvalidInputError(
            "job_name is empty: give the job a name (it keys its lock and its run records), "
            "or leave job_name out to use <dag_id>.<task_id>"
        )
    if is_templated(value):
        return value
    return _check(value, "job_name", f"shorten it to at most {MAX_KEY_LENGTH} characters")


_shorter = (
    f"the job's name keys its run records and may have at most {MAX_KEY_LENGTH} characters: "
    "give the task a job_name= that fits"
)


def _check(value: str, what: str, fix: str) -> str:
    try:
        return check_text(value, what)
    except InvalidInputError as exc:
        too_long = len(value) > MAX_KEY_LENGTH
        raise InvalidInputError(f"{exc}; {fix}" if too_long else str(exc)) from None


def check_key_segment(value: object) -> str | None:
    """A mapped task's ``key_segment`` (``eu``), unless templated or ``None``, or raise."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidInputError(
            f"key_segment must be text such as 'eu', got {type(value).__name__}: {value!r}"
        )
    if is_templated(value):
        return value
    if not value or value != value.strip() or SEGMENT_DELIMITER in value:
        raise InvalidInputError(
            f"key_segment {value!r}: a segment is non-empty text without leading or trailing "
            f"blanks and without {SEGMENT_DELIMITER!r} (it is written before the period: "
            f"eu{SEGMENT_DELIMITER}2026-10-01)"
        )
    # Its one spelling (key_spelling): NFC, no invisible characters, not read as a period
    # or as the CLI's '*' marker.
    return check_label(check_text(value, "key_segment"), "key_segment", value)


def check_run_key_rule(value: object) -> RunKeyRule | Callable[..., Any]:
    """A :class:`RunKeyRule` or a callable of the context, or raise (``None``: the default
    daily rule)."""
    if value is None:
        return RunKeyRule()
    if isinstance(value, RunKeyRule) or (callable(value) and not isinstance(value, type)):
        return value
    hint = ""
    if isinstance(value, str):
        hint = f": for a period, write run_key_rule=RunKeyRule(period={value!r})"
    raise InvalidInputError(
        f"run_key_rule must be a RunKeyRule (e.g. RunKeyRule(period='day')) or a function "
        f"of the task context returning the run key, got {type(value).__name__} {value!r}{hint}"
    )


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else raise naming them."""
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise InvalidInputError(f"{name} must be one of {listed}, not {value!r}")
    return value


def check_duration(name: str, value: object) -> dt.timedelta:
    """A positive ``datetime.timedelta``, or raise."""
    if not isinstance(value, dt.timedelta):
        raise InvalidInputError(
            f"{name} must be a datetime.timedelta (e.g. timedelta(seconds=30)), got "
            f"{type(value).__name__}: {value!r}"
        )
    if value <= dt.timedelta(0):
        raise InvalidInputError(f"{name} must be positive, got {value}")
    return value


def check_flag(name: str, value: object) -> bool:
    """``True`` or ``False``, nothing else (``"false"`` would be true), or raise."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {value!r}")
    return value


def check_conn_id(value: object) -> str:
    """An Airflow connection id: non-empty text, or raise."""
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise InvalidInputError(
            f"postgres_conn_id must name an Airflow connection (e.g. 'idempotency_default'), "
            f"got {value!r}"
        )
    return value


_CHECKS: dict[str, Callable[[object], object]] = {
    "postgres_conn_id": check_conn_id,
    "run_key_rule": check_run_key_rule,
    "on_locked": lambda value: check_choice("on_locked", value, ON_LOCKED),
    "on_completed": lambda value: check_choice("on_completed", value, ON_COMPLETED),
    "reschedule_interval": lambda value: check_duration("reschedule_interval", value),
    "lock_timeout": lambda value: check_duration("lock_timeout", value),
    "schema": lambda value: validate_schema_name(value),  # type: ignore[arg-type]
    "key_segment": check_key_segment,
    "emit_on_noop": lambda value: check_flag("emit_on_noop", value),
}
"""The operator's arguments and their checks (``job_name`` has its own: its default)."""


def check_arguments(
    where: str, given: Mapping[str, object], *, default_job_name: str | None
) -> None:
    """Check the operator's arguments ``given`` (``job_name`` and the names of
    :data:`_CHECKS` that it holds); raise :class:`InvalidInputError` naming ``where`` (the
    task, and its DAG), the argument and what to give instead. ``default_job_name``: see
    :func:`check_job_name`."""
    try:
        check_job_name(given.get("job_name"), default=default_job_name)
        for name, check in _CHECKS.items():
            if name in given:
                check(given[name])
    except InvalidInputError as exc:
        raise InvalidInputError(f"{where}: {exc}") from None


def unsegmented_mapped_task(where: str) -> str:
    """The refusal of a mapped task without ``key_segment`` (a mapped ``@task.idempotent_run``
    where the DAG file is parsed, any mapped instance when it runs)."""
    return (
        f"{where} is mapped, and without key_segment all its mapped instances share one run "
        f"key (one lock, one record): the first would do its work and every other would be a "
        f"no-op, its input never processed. Give each instance its own segment: "
        f".partial(...).expand(key_segment=[...]) for the operator, or "
        f"key_segment=\"{{{{ task.op_kwargs['region'] }}}}\" naming the mapped argument "
        f"(templated); or a run_key_rule function of the context that tells them apart"
    )


def check_work_function(
    function: Callable[..., Any], args: Sequence[object], kwargs: Mapping[str, object]
) -> None:
    """Raise unless ``function`` can be called as the operator calls it: with the
    RunContext first, then ``args`` and ``kwargs`` (``op_args``, ``op_kwargs``; for
    ``@task.idempotent_run``, the call's arguments). A function without a signature that
    Python can read (some builtins) is not checked."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, *args, **kwargs)
    except TypeError as exc:
        name = getattr(function, "__name__", type(function).__name__)
        parameters = signature.replace(return_annotation=inspect.Signature.empty)
        raise InvalidInputError(
            f"python_callable {name}{parameters} cannot take the RunContext as its first "
            f"argument ({exc}): the operator calls it as {name}(run, *op_args, **op_kwargs); "
            f"write it as def {name}(run: RunContext, ...)"
        ) from None


def check_mapped_arguments(
    task_id: str, dag_id: str | None, given: Mapping[str, object], *, expanded: bool = False
) -> None:
    """Check the arguments a mapped task was given in the DAG file (``.partial(...)``, or
    ``@task.idempotent_run(...)`` before ``.expand()``): the constructor runs only when each
    mapped task is made, at run time, so these are checked here, as the constructor checks
    them. The expanded ones, and the default job name, are checked then. ``expanded``: no
    argument of the operator is mapped (a decorated task maps its function's), so a mapped
    task without ``key_segment`` and without a ``run_key_rule`` function is refused too."""
    where = f"task {task_id!r}" + (f" of DAG {dag_id!r}" if dag_id else "")
    names = ("job_name", *_CHECKS)
    check_arguments(where, {k: v for k, v in given.items() if k in names}, default_job_name=None)
    rule = given.get("run_key_rule")
    if expanded and given.get("key_segment") is None and not callable(rule):
        raise InvalidInputError(unsegmented_mapped_task(where))
