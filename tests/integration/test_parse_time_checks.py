"""Mistakes in an idempotent task's arguments are refused where the DAG file is parsed.

The checks (airflow_idempotency.arguments, RunKeyRule) as properties over generated input,
then through a real DagBag of each Airflow line: the DAG file fails to import, with the
message Airflow's UI shows as its import error, and nothing runs at 01:00.
"""

from __future__ import annotations

import datetime as dt
import textwrap
import unicodedata
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from airflow_idempotency.arguments import (
    check_choice,
    check_duration,
    check_job_name,
    check_key_segment,
    check_run_key_rule,
    is_templated,
)
from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.key_spelling import IGNORABLE, folded, reads_as_time, spelling_of
from airflow_idempotency.run_key import MAX_KEY_LENGTH, MAX_OFFSET, RunKeyRule, check_text

PERIODS = ("hour", "day", "week", "month")

# Deterministic: the same examples on every run (no seed to print), fast.
PROPERTY = settings(max_examples=400, deadline=None, database=None, derandomize=True)
NAMES = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=190, max_size=210),
    st.sampled_from(["job", " job", "job ", "a\x00b", "x" * 200, "x" * 201, "{{ params.job }}"]),
)


def _acceptable(name: str) -> bool:
    """A job name the run records take: what check_text, the run-time check, accepts."""
    try:
        check_text(name, "job name")
    except InvalidInputError:
        return False
    return True


@PROPERTY
@given(name=NAMES)
@example(name="")
@example(name="\u200b")
def test_a_job_name_is_refused_at_parse_time_exactly_when_the_run_would_refuse_it(
    name: str,
) -> None:
    """An untemplated job name passes the parse-time check if and only if the run-time
    check would take it; a templated one is left for run time; "" is never taken."""
    if is_templated(name):
        assert check_job_name(name) == name
        return
    if _acceptable(name) and name:
        assert check_job_name(name) == name
    else:
        with pytest.raises(InvalidInputError, match="job_name"):
            check_job_name(name)


@PROPERTY
@given(dag_id=st.text(alphabet="abc_", min_size=1, max_size=260))
def test_the_default_job_name_must_fit_the_run_records(dag_id: str) -> None:
    """With no job_name, <dag_id>.<task_id> must fit too: a long dag_id is refused when
    parsed, naming job_name= as the way out."""
    default = f"{dag_id}.work"
    if len(default) <= MAX_KEY_LENGTH:
        assert check_job_name(None, default=default) is None
    else:
        with pytest.raises(InvalidInputError, match="give the task a job_name="):
            check_job_name(None, default=default)


@PROPERTY
@given(value=st.one_of(st.integers(), st.binary(max_size=4), st.lists(st.text(), max_size=2)))
def test_a_job_name_that_is_not_text_is_refused(value: object) -> None:
    """Anything but text (or None) as job_name is refused, naming its type."""
    with pytest.raises(InvalidInputError, match="must be text"):
        check_job_name(value)


@PROPERTY
@given(segment=st.text(max_size=8))
@example(segment="eu|us")
@example(segment=" eu")
@example(segment="*")
@example(segment="2026-10")
@example(segment="e\u200bu")
@example(segment="\u0301eu")
@example(segment="eu\ufe0f")
@example(segment="2026/1/1")
def test_a_key_segment_is_one_clean_label(segment: str) -> None:
    """A key_segment passes iff it is non-empty, unpadded, without '|' (in any width), in
    NFC, without invisible characters, and no period, time or '*' marker in any digits."""
    refused = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")
    fold = folded(segment)
    ok = (
        segment != ""
        and segment == segment.strip()
        and "|" not in fold
        and not any(unicodedata.category(c) in refused for c in segment)
        and not any(unicodedata.category(c) == "Zs" and c != " " for c in segment)
        and not any(ord(c) in IGNORABLE for c in segment)
        and not unicodedata.category(segment[:1] or "a").startswith("M")
        and unicodedata.normalize("NFC", segment) == segment
        and fold not in ("*", "{}")
        and not reads_as_time(fold)
        and (fold.isdigit() or all(spelling_of(segment, p) is None for p in PERIODS))
    )
    if is_templated(segment) or ok:
        assert check_key_segment(segment) == segment
    else:
        with pytest.raises(InvalidInputError, match="key_segment"):
            check_key_segment(segment)


@PROPERTY
@given(value=st.text(max_size=10))
@example(value="reschedule")
@example(value="Reschedule")
def test_a_policy_is_one_of_its_words(value: str) -> None:
    """on_locked takes exactly its three words (case matters), and names them when refusing."""
    if value in ("reschedule", "fail", "skip"):
        assert check_choice("on_locked", value, ("reschedule", "fail", "skip")) == value
    else:
        with pytest.raises(InvalidInputError, match="'reschedule', 'fail', 'skip'"):
            check_choice("on_locked", value, ("reschedule", "fail", "skip"))


@PROPERTY
@given(seconds=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))
def test_a_wait_is_a_positive_timedelta(seconds: float) -> None:
    """reschedule_interval and lock_timeout: a positive timedelta; zero, negative or a bare
    number of seconds is refused."""
    wait = dt.timedelta(seconds=seconds)
    if wait > dt.timedelta(0):
        assert check_duration("lock_timeout", wait) == wait
    else:
        with pytest.raises(InvalidInputError, match="must be positive"):
            check_duration("lock_timeout", wait)
    with pytest.raises(InvalidInputError, match=r"datetime\.timedelta"):
        check_duration("lock_timeout", seconds)


@PROPERTY
@given(
    period=st.one_of(st.sampled_from(["hour", "day", "week", "month"]), st.text(max_size=8)),
    offset=st.one_of(st.none(), st.integers(), st.booleans(), st.floats(allow_nan=False)),
)
def test_a_run_key_rule_is_checked_when_built(period: str, offset: object) -> None:
    """RunKeyRule refuses an unknown period and an offset that is not a whole number of
    periods within MAX_OFFSET, when the DAG file builds it."""
    period_ok = period in ("hour", "day", "week", "month")
    offset_ok = offset is None or (
        isinstance(offset, int) and not isinstance(offset, bool) and abs(offset) <= MAX_OFFSET
    )
    if period_ok and offset_ok:
        RunKeyRule(period=period, offset=offset)  # type: ignore[arg-type]
    else:
        with pytest.raises(InvalidInputError, match=r"period|offset"):
            RunKeyRule(period=period, offset=offset)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["day", "daily", 1, RunKeyRule])
def test_a_run_key_rule_must_be_a_rule_or_a_function(value: object) -> None:
    """A string, a number or the class itself is refused; a period's name is pointed at
    RunKeyRule(period=...)."""
    with pytest.raises(InvalidInputError, match="RunKeyRule") as refused:
        check_run_key_rule(value)
    if value == "day":
        assert "run_key_rule=RunKeyRule(period='day')" in str(refused.value)
    assert isinstance(check_run_key_rule(RunKeyRule(period="week")), RunKeyRule)
    assert check_run_key_rule(len) is len


# -- through a real DagBag, as the DAG processor imports the file ----------------------------

_DAG_FILE = """\
import datetime as dt

import pendulum
from airflow.providers.common.compat.sdk import DAG, task

from airflow_idempotency import IdempotentRunOperator, RunContext, RunKeyRule, idempotency_params


def work(run: RunContext) -> None:
    pass


with DAG(
    {dag_id!r},
    schedule=None,
    start_date=pendulum.datetime(2026, 10, 1, tz="UTC"),
    params={params},
):
{tasks}
"""

# (what is wrong, the DAG's params, its task(s), a phrase the import error must hold)
MISTAKES = [
    (
        "empty_job_name",
        "{}",
        """
    @task.idempotent_run(job_name="")
    def step(run: RunContext) -> None:
        pass

    step()""",
        "task 'step' of DAG 'empty_job_name': job_name is empty",
    ),
    (
        "long_job_name",
        "{}",
        'IdempotentRunOperator(task_id="step", python_callable=work, job_name="j" * 300)',
        f"job_name is 300 characters long; at most {MAX_KEY_LENGTH}",
    ),
    (
        "long_default_name_" + "d" * 190,
        "{}",
        'IdempotentRunOperator(task_id="step", python_callable=work)',
        "give the task a job_name= that fits",
    ),
    (
        "unknown_period",
        "{}",
        'IdempotentRunOperator(task_id="step", python_callable=work, run_key_rule=RunKeyRule(period="daily"))',
        "unknown period 'daily'",
    ),
    (
        "period_as_text",
        "{}",
        'IdempotentRunOperator(task_id="step", python_callable=work, run_key_rule="week")',
        "run_key_rule=RunKeyRule(period='week')",
    ),
    (
        "unknown_params_period",
        'idempotency_params("fortnight")',
        'IdempotentRunOperator(task_id="step", python_callable=work)',
        "unknown period 'fortnight'",
    ),
    (
        "bad_policy",
        "{}",
        'IdempotentRunOperator(task_id="step", python_callable=work, on_locked="wait")',
        "on_locked must be one of 'reschedule', 'fail', 'skip', not 'wait'",
    ),
    (
        "bad_wait",
        "{}",
        'IdempotentRunOperator(task_id="step", python_callable=work, lock_timeout=dt.timedelta(0))',
        "lock_timeout must be positive",
    ),
    (
        "bad_schema",
        "{}",
        'IdempotentRunOperator(task_id="step", python_callable=work, schema="Jobs-Schema")',
        "invalid schema name 'Jobs-Schema'",
    ),
    (
        "mapped_operator",
        "{}",
        """
    IdempotentRunOperator.partial(
        task_id="step", python_callable=work, on_locked="wait"
    ).expand(key_segment=["eu", "us"])""",
        "task 'step' of DAG 'mapped_operator': on_locked must be one of",
    ),
    (
        "mapped_decorator",
        "{}",
        """
    @task.idempotent_run(job_name="")
    def step(run: RunContext, region: str) -> None:
        pass

    step.expand(region=["eu", "us"])""",
        "task 'step' of DAG 'mapped_decorator': job_name is empty",
    ),
    (
        "mapped_override",
        "{}",
        """
    @task.idempotent_run
    def step(run: RunContext, region: str) -> None:
        pass

    step.override(lock_timeout=300).expand(region=["eu", "us"])""",
        "lock_timeout must be a datetime.timedelta",
    ),
    (
        "mapped_without_segment",
        "{}",
        """
    @task.idempotent_run
    def step(run: RunContext, region: str) -> None:
        pass

    step.expand(region=["eu", "us"])""",
        "is mapped, and without key_segment all its mapped instances share one run key",
    ),
    (
        "work_without_run",
        "{}",
        'IdempotentRunOperator(task_id="step", python_callable=lambda: None)',
        "task 'step' of DAG 'work_without_run': python_callable <lambda>() cannot take the "
        "RunContext as its first argument",
    ),
    (
        "decorated_without_run",
        "{}",
        """
    @task.idempotent_run
    def step() -> None:
        pass

    step()""",
        "task 'step': python_callable step() cannot take the RunContext as its first argument",
    ),
    (
        "bad_segment",
        "{}",
        'IdempotentRunOperator(task_id="step", python_callable=work, key_segment="eu|us")',
        "key_segment 'eu|us'",
    ),
]


def _write_dag(folder: Path, dag_id: str, params: str, tasks: str) -> Path:
    body = textwrap.indent(textwrap.dedent(tasks).strip("\n"), "    ")
    path = folder / f"{dag_id[:40]}.py"
    path.write_text(_DAG_FILE.format(dag_id=dag_id, params=params, tasks=body), encoding="utf-8")
    return path


@pytest.mark.both_airflow_lines
def test_the_dag_processor_shows_each_mistake_as_an_import_error(
    airflow_home: Path, tmp_path: Path
) -> None:
    """Each DAG file with a wrong argument fails to import in the line's DagBag (what the
    DAG processor runs), its import error naming the task and the mistake, a mapped task's
    (.partial() of the operator, @task.idempotent_run and .override() before .expand())
    too; the same file with the mistakes fixed imports cleanly."""
    from support.dag_runs import load_dag_bag

    for dag_id, params, tasks, _ in MISTAKES:
        _write_dag(tmp_path, dag_id, params, tasks)
    _write_dag(
        tmp_path,
        "fixed",
        "idempotency_params()",
        """
    @task.idempotent_run(job_name="fixed.step", on_locked="fail")
    def step(run: RunContext) -> None:
        pass

    step()
    IdempotentRunOperator(
        task_id="classic",
        python_callable=work,
        job_name="{{ params.run_key }}.classic",
        key_segment="{{ params.segment }}",
        run_key_rule=RunKeyRule(period="week", offset=-1),
        lock_timeout=dt.timedelta(minutes=5),
    )
    IdempotentRunOperator.partial(
        task_id="mapped", python_callable=work, on_locked="skip"
    ).expand(key_segment=["eu", "us"])

    @task.idempotent_run(
        job_name="fixed.mapped_step", key_segment="{{ task.op_kwargs['region'] }}"
    )
    def mapped_step(run: RunContext, region: str) -> None:
        pass

    mapped_step.expand(region=["eu", "us"])""",
    )
    bag = load_dag_bag(tmp_path)
    errors = {Path(path).name: message for path, message in bag.import_errors.items()}
    for dag_id, _, _, phrase in MISTAKES:
        message = errors.pop(f"{dag_id[:40]}.py", None)
        assert message is not None, f"{dag_id}: imported without an error"
        assert phrase in message, f"{dag_id}: {message[-500:]}"
        assert "InvalidInputError" in message, message[-500:]
    assert not errors, errors
    assert "fixed" in bag.dags
