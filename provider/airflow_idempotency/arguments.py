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
from collections.abc import Callable, Mapping
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
    """Check the operator's arguments ``given`` (``job_name`` and every name of
    :data:`_CHECKS`); raise :class:`InvalidInputError` naming ``where`` (the task, and its
    DAG), the argument and what to give instead. ``default_job_name``: see
    :func:`check_job_name`."""
    try:
        check_job_name(given["job_name"], default=default_job_name)
        for name, check in _CHECKS.items():
            check(given[name])
    except InvalidInputError as exc:
        raise InvalidInputError(f"{where}: {exc}") from None
