"""The cluster policy's decisions as properties (docs/policy.md): which tags switch it on,
which schedules it keys by day, which tasks it leaves alone."""

from __future__ import annotations

import datetime as dt
import types

import pytest
from airflow.timetables.interval import CronDataIntervalTimetable, DeltaDataIntervalTimetable
from airflow.timetables.simple import NullTimetable
from airflow.timetables.trigger import CronTriggerTimetable
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_idempotency import policy

PROPERTY = settings(max_examples=200, deadline=None, database=None, derandomize=True)
TIMETABLES = [CronTriggerTimetable, CronDataIntervalTimetable]


def _dag(timetable: object) -> object:
    return types.SimpleNamespace(timetable=timetable, timezone="UTC", dag_id="d")


@PROPERTY
@given(
    tags=st.lists(st.text(alphabet="abc-_ ", max_size=6), max_size=5),
    separator=st.sampled_from([",", ", ", " ,"]),
)
def test_the_tags_are_the_setting_split_on_commas_and_trimmed(
    tags: list[str], separator: str
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", separator.join(tags))
        assert policy.policy_tags() == {t.strip() for t in tags if t.strip()}


def test_without_the_setting_there_are_no_tags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", raising=False)
    assert policy.policy_tags() == frozenset()


@PROPERTY
@given(
    minute=st.integers(0, 59),
    hours=st.sets(st.integers(0, 23), min_size=1, max_size=4),
    weekdays=st.sampled_from(["*", "1-5", "0", "6"]),
    timetable=st.sampled_from(TIMETABLES),
)
def test_a_cron_schedule_is_refused_exactly_when_it_fires_twice_in_a_day(
    minute: int, hours: set[int], weekdays: str, timetable: type
) -> None:
    expression = f"{minute} {','.join(map(str, sorted(hours)))} * * {weekdays}"
    refusal = policy.key_refusal(_dag(timetable(expression, timezone="UTC")))
    if len(hours) == 1:
        assert refusal is None, (expression, refusal)
    else:
        assert refusal is not None and "more than once a day" in refusal


@PROPERTY
@given(hours=st.integers(1, 24 * 10))
def test_a_timedelta_schedule_is_refused_exactly_when_shorter_than_a_day(hours: int) -> None:
    refusal = policy.key_refusal(_dag(DeltaDataIntervalTimetable(dt.timedelta(hours=hours))))
    assert (refusal is None) == (hours >= 24)


def test_runs_without_a_business_date_are_refused() -> None:
    refusal = policy.key_refusal(_dag(NullTimetable()))
    assert refusal is not None and "no business date" in refusal
