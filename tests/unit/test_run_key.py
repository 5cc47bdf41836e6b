"""Run-key rules: how Airflow's logical date becomes the business period (no database)."""

from __future__ import annotations

import datetime as dt
import unicodedata
from typing import Any

import pendulum
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_idempotency.exceptions import (
    InvalidInputError,
    InvalidRunKeyError,
    PeriodNotEndedError,
    RunKeyMissingError,
)
from airflow_idempotency.run_key import (
    Period,
    ResolvedRunKey,
    RunFacts,
    RunKeyRule,
    check_text,
    resolve_run_key,
)

NOW = pendulum.datetime(2026, 11, 29, 8, 0, tz="UTC")


def resolve(rule: RunKeyRule | None = None, **overrides: Any) -> ResolvedRunKey:
    args: dict[str, Any] = {
        "timezone": "UTC",
        "timetable_name": "CronTriggerTimetable",
        "run_type": "scheduled",
        "logical_date": pendulum.datetime(2026, 10, 2, 1, tz="UTC"),
        "now": NOW,
    }
    args.update(overrides)
    return resolve_run_key(rule or RunKeyRule(), RunFacts(**args))


def test_cron_trigger_timetable_maps_to_previous_day() -> None:
    """A cron run fired at D+1 01:00 (CronTriggerTimetable) processes business date D."""
    assert resolve().run_key == "2026-10-01"


@pytest.mark.parametrize("timetable", ["CronDataIntervalTimetable", "DeltaDataIntervalTimetable"])
def test_data_interval_timetables_map_to_interval_day(timetable: str) -> None:
    """Data-interval timetables give the interval start as logical date: that day is the key."""
    got = resolve(
        timetable_name=timetable, logical_date=pendulum.datetime(2026, 10, 1, 1, tz="UTC")
    )
    assert got.run_key == "2026-10-01"


def test_explicit_offset_overrides_timetable_default() -> None:
    """An author-chosen offset wins over the timetable default."""
    assert resolve(rule=RunKeyRule(offset=0)).run_key == "2026-10-02"
    assert resolve(rule=RunKeyRule(offset=-2)).run_key == "2026-09-30"


@pytest.mark.parametrize(
    ("period", "logical", "expected"),
    [
        ("hour", pendulum.datetime(2026, 10, 2, 1, tz="UTC"), "2026-10-02T00Z"),
        ("week", pendulum.datetime(2026, 10, 5, 1, tz="UTC"), "2026-W40"),
        ("month", pendulum.datetime(2026, 10, 1, 1, tz="UTC"), "2026-09"),
        ("month", pendulum.datetime(2026, 1, 1, 1, tz="UTC"), "2025-12"),
    ],
)
def test_other_periods(period: Period, logical: dt.datetime, expected: str) -> None:
    """Hourly, weekly and monthly jobs get keys of their own period, the previous one by default."""
    assert resolve(rule=RunKeyRule(period=period), logical_date=logical).run_key == expected


@pytest.mark.parametrize(
    ("utc_fire_time", "expected"),
    [
        # 2026-03-29: clocks go forward in Amsterdam (02:00 -> 03:00). 00:30 local is UTC-1h
        # before, UTC-2h after the change.
        (pendulum.datetime(2026, 3, 28, 23, 30, tz="UTC"), "2026-03-28"),  # 29 Mar 00:30 CET
        (pendulum.datetime(2026, 3, 29, 22, 30, tz="UTC"), "2026-03-29"),  # 30 Mar 00:30 CEST
        # 2026-10-25: clocks go back (03:00 -> 02:00).
        (pendulum.datetime(2026, 10, 24, 22, 30, tz="UTC"), "2026-10-24"),  # 25 Oct 00:30 CEST
        (pendulum.datetime(2026, 10, 25, 23, 30, tz="UTC"), "2026-10-25"),  # 26 Oct 00:30 CET
    ],
)
def test_amsterdam_dag_maps_to_local_business_date_across_dst(
    utc_fire_time: dt.datetime, expected: str
) -> None:
    """A DAG in Europe/Amsterdam firing at 00:30 local processes the previous local day on both DST changes."""
    got = resolve(timezone="Europe/Amsterdam", logical_date=utc_fire_time)
    assert got.run_key == expected


def test_hourly_keys_are_unambiguous_when_dst_ends() -> None:
    """The two local 02:00 hours of 25 Oct 2026 in Amsterdam get different (UTC) keys."""
    rule = RunKeyRule(period="hour", offset=0)
    first = pendulum.datetime(2026, 10, 25, 0, 30, tz="UTC")  # 02:30 CEST
    second = pendulum.datetime(2026, 10, 25, 1, 30, tz="UTC")  # 02:30 CET
    keys = {rule.key_for(first, "Europe/Amsterdam", 0), rule.key_for(second, "Europe/Amsterdam", 0)}
    assert keys == {"2026-10-25T00Z", "2026-10-25T01Z"}


def test_manual_explicit_run_key_wins() -> None:
    """A manual run's run_key in conf wins over its logical date, and says so."""
    got = resolve(run_type="manual", conf_run_key="2026-09-15")
    assert (got.run_key, got.source) == ("2026-09-15", "conf")


def test_manual_run_from_logical_date_is_flagged() -> None:
    """A manual run keyed from its logical date says so plainly in the explanation."""
    got = resolve(run_type="manual")
    assert got.source == "logical_date"
    assert got.explanation.startswith("NOTE: this manual run has no explicit run_key")


def test_manual_run_without_logical_date_or_run_key_is_refused() -> None:
    """No logical date and no run_key: the error names run_key and its format."""
    with pytest.raises(RunKeyMissingError, match=r"run_key.*YYYY-MM-DD"):
        resolve(run_type="manual", logical_date=None)


@pytest.mark.parametrize(
    ("period", "example"),
    [("hour", "2026-10-01T13Z"), ("day", "2026-10-01"), ("week", "2026-W40"), ("month", "2026-10")],
)
def test_the_refusal_of_a_run_without_a_key_gives_a_command_of_its_period(
    period: str, example: str
) -> None:
    """The command the message gives to copy has a key of the rule's period: a weekly job
    told to trigger with "2026-10-01" would be refused again as malformed. The same for
    the refusal of a malformed key."""
    with pytest.raises(RunKeyMissingError) as refused:
        resolve(RunKeyRule(period=period), run_type="manual", logical_date=None)  # type: ignore[arg-type]
    assert f"""-c '{{"run_key": "{example}"}}'""" in str(refused.value)
    malformed = "2026-10-01-x"
    with pytest.raises(InvalidRunKeyError) as refused_key:
        resolve(RunKeyRule(period=period), run_type="manual", conf_run_key=malformed)  # type: ignore[arg-type]
    assert f"""conf {{"run_key": "{example}"}}""" in str(refused_key.value)


@pytest.mark.parametrize(
    "bad",
    [
        "2026-13-01",
        "2026-02-30",
        "yesterday",
        "2026-10-01'; DROP TABLE job_runs; --",
        "26-10-01",
        " 2026-10-01",
        20261001,
    ],
)
def test_malformed_run_keys_are_refused(bad: object) -> None:
    """Malformed keys are refused with the expected format in the message."""
    with pytest.raises(InvalidRunKeyError, match="YYYY-MM-DD"):
        resolve(run_type="manual", conf_run_key=bad)


def test_explicit_run_key_is_refused_for_backfill_runs() -> None:
    """A run_key in a backfill's conf would map every date onto one key: refused."""
    with pytest.raises(InvalidRunKeyError, match="only manual runs"):
        resolve(run_type="backfill", conf_run_key="2026-10-01")


def test_period_not_ended_is_refused_by_default() -> None:
    """A UI trigger at 00:30 whose logical date was pre-filled with 'now' is caught."""
    with pytest.raises(PeriodNotEndedError, match="has not ended yet"):
        resolve(run_type="manual", conf_run_key="2026-11-29")
    with pytest.raises(PeriodNotEndedError):
        resolve(run_type="manual", rule=RunKeyRule(offset=0), logical_date=NOW)


def test_period_not_ended_allowed_when_author_opts_in() -> None:
    """allow_open_period=True accepts today's key."""
    got = resolve(
        run_type="manual", conf_run_key="2026-11-29", rule=RunKeyRule(allow_open_period=True)
    )
    assert got.run_key == "2026-11-29"


def test_period_end_uses_dag_timezone() -> None:
    """In Asia/Tokyo, 2026-11-29 has ended at 2026-11-29 16:00 UTC (01:00 next day local)."""
    now = pendulum.datetime(2026, 11, 29, 16, tz="UTC")
    got = resolve(run_type="manual", conf_run_key="2026-11-29", timezone="Asia/Tokyo", now=now)
    assert got.run_key == "2026-11-29"
    with pytest.raises(PeriodNotEndedError):
        resolve(run_type="manual", conf_run_key="2026-11-29", timezone="UTC", now=now)


@pytest.mark.parametrize("bad", ["", " padded", "tab\there", "nul\x00", "x" * 201, None, 7])
def test_free_text_checks(bad: object) -> None:
    """Job names and free-form keys refuse empty, padded, control characters, overlong, non-text."""
    with pytest.raises(InvalidInputError):
        check_text(bad, "job name")


@pytest.mark.parametrize(
    "good", ['O\'Brien "quoted" job', "factures-été-✓", "日次ジョブ", "a;DROP TABLE x"]
)
def test_free_text_accepts_quotes_and_unicode(good: str) -> None:
    """Quotes, unicode and SQL-looking text are fine as data: they only travel as parameters."""
    assert check_text(good, "job name") == good


# Zero of every decimal digit script Python's \d and int() accept (category Nd), but ASCII.
_OTHER_ZEROS = sorted(
    {
        chr(c - unicodedata.digit(chr(c)))
        for c in range(0x80, 0x110000)
        if unicodedata.category(chr(c)) == "Nd" and unicodedata.digit(chr(c), None) is not None
    }
)


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(
    period_key=st.sampled_from(
        [
            ("day", "2026-10-01"),
            ("hour", "2026-10-01T13Z"),
            ("week", "2026-W40"),
            ("month", "2026-10"),
        ]
    ),
    zero=st.sampled_from(_OTHER_ZEROS),
    segment=st.sampled_from(["", "eu|"]),
)
def test_a_run_key_in_other_digits_is_refused_not_a_second_key(
    period_key: tuple[str, str], zero: str, segment: str
) -> None:
    """A manual run_key written in fullwidth, Arabic-Indic, Devanagari, ... digits names the
    same period as the ASCII key, but would be another key: another lock and record, the
    period done twice. Refused, naming its one spelling."""
    period, key = period_key
    other = "".join(chr(ord(zero) + int(c)) if c.isdigit() else c for c in key)
    with pytest.raises(InvalidRunKeyError, match="non-ASCII digits"):
        resolve(
            RunKeyRule(period=period),  # type: ignore[arg-type]
            run_type="manual",
            conf_run_key=segment + other,
        )
