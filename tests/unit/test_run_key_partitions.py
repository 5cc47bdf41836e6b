"""Run keys of partitioned runs (Airflow 3.2+): the partition key becomes the run key, in
one precedence with the conf's run_key and the logical date (no database, no Airflow)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pendulum
import pytest

from airflow_idempotency.exceptions import (
    ConfigurationError,
    InvalidInputError,
    InvalidRunKeyError,
    PeriodNotEndedError,
    RunKeyConflictError,
    RunKeyMissingError,
)
from airflow_idempotency.partitions import PartitionSpec
from airflow_idempotency.run_key import (
    RunFacts,
    RunKeyRule,
    key_parts,
    resolve_run_key,
    segment_template,
)

NOW = pendulum.datetime(2026, 11, 29, 8, 0, tz="UTC")


def facts(**overrides: Any) -> RunFacts:
    args: dict[str, Any] = {
        "run_type": "scheduled",
        "timezone": "UTC",
        "now": NOW,
        "timetable_name": "CronPartitionTimetable",
        "partitioned": True,
    }
    args.update(overrides)
    return RunFacts(**args)


def key(partition_key: str, rule: RunKeyRule | None = None, **overrides: Any) -> str:
    resolved = resolve_run_key(
        rule or RunKeyRule(), facts(partition_key=partition_key, **overrides)
    )
    assert resolved.source in ("partition_key", "conf", "params")
    return resolved.run_key


# -- time partitions keep history -----------------------------------------------------------


@pytest.mark.parametrize(
    ("period", "cron_fire", "key_format", "partition_shift"),
    [
        ("day", {"days": 1, "hours": 1}, "%Y-%m-%dT%H:%M:%S", {"days": -1}),
        ("day", {"days": 1, "hours": 1}, "%Y%m%d", {"days": -1}),
        ("day", {"days": 1, "hours": 1}, "%Y-%m-%d", {"days": -1}),
        ("hour", {"hours": 1, "minutes": 5}, "%Y-%m-%dT%H:%M:%S", {"hours": -1}),
        ("week", {"weeks": 1, "hours": 2}, "%Y-%m-%dT%H:%M:%S", {"weeks": -1}),
        ("month", {"months": 1, "hours": 3}, "%Y-%m", {"months": -1}),
    ],
)
@pytest.mark.parametrize("timezone", ["UTC", "Europe/Amsterdam", "America/New_York"])
def test_a_time_partition_gets_the_key_its_cron_run_had(
    period: Any, cron_fire: dict[str, int], key_format: str, partition_shift: Any, timezone: str
) -> None:
    """For 60 periods, the run a cron DAG (CronTriggerTimetable) fired for a period and the
    run CronPartitionTimetable with run_offset=-1 makes for it get the same run key, in the
    DAG's timezone, with the default and other key formats and at every grain."""
    rule = RunKeyRule(period=period)
    start = pendulum.datetime(2021, 1, 4, tz=timezone)  # a Monday; 60 months end before now
    for n in range(60):
        anchor = start.add(**{f"{period}s": n})
        fire = anchor.add(**cron_fire)  # the cron tick that closes the period
        cron_key = resolve_run_key(
            rule,
            facts(
                timetable_name="CronTriggerTimetable",
                partitioned=False,
                logical_date=fire,
                timezone=timezone,
            ),
        ).run_key
        # CronPartitionTimetable(run_offset=-1): the partition date is the previous tick,
        # the key that tick in the timetable's timezone, formatted with key_format.
        partition_date = fire.add(**partition_shift)
        partition_key = partition_date.in_timezone(timezone).strftime(key_format)
        spec = PartitionSpec(time_formats=(key_format,), timezone=timezone)
        assert key(partition_key, rule, timezone=timezone, partition_spec=spec) == cron_key


def test_a_partition_key_is_read_in_the_timetables_timezone() -> None:
    """An Asia/Tokyo partition at local midnight is that local day, also for a UTC DAG."""
    spec = PartitionSpec(timezone="Asia/Tokyo")
    assert key("2026-10-02T00:00:00", partition_spec=spec) == "2026-10-02"
    assert key("2026-10-01T15:00:00+00:00") == "2026-10-01"  # an offset wins: UTC


def test_grains_finer_than_the_period_key_the_period_that_holds_them() -> None:
    """Hour, day and week partitions of the mappers' default formats map to their period."""
    assert key("2026-10-01T13", RunKeyRule(period="hour")) == "2026-10-01T13Z"
    assert key("2026-10-01T13", RunKeyRule(period="day")) == "2026-10-01"
    assert key("2026-09-28 (W40)", RunKeyRule(period="week")) == "2026-W40"
    assert key("2026-10-07", RunKeyRule(period="week")) == "2026-W41"
    assert key("2026-10", RunKeyRule(period="month")) == "2026-10"


@pytest.mark.parametrize(
    ("partition_key", "rule", "message"),
    [
        ("2026-10", RunKeyRule(period="day"), "names a month"),
        ("2026-09-28 (W40)", RunKeyRule(period="day"), "names a week"),
        ("2026-Q3", RunKeyRule(period="month"), "names a quarter"),
        ("2026-10-01", RunKeyRule(period="hour"), "names a day"),
    ],
)
def test_a_partition_of_a_longer_period_than_the_jobs_is_refused(
    partition_key: str, rule: RunKeyRule, message: str
) -> None:
    """A month partition cannot name one day of work: refused, naming both periods."""
    with pytest.raises(InvalidRunKeyError, match=message):
        key(partition_key, rule)


def test_a_partition_whose_period_has_not_ended_is_refused() -> None:
    """CronPartitionTimetable without run_offset keys the run at D+1 01:00 as D+1: the day
    has not ended, refused unless the rule allows open periods."""
    with pytest.raises(PeriodNotEndedError, match="has not ended"):
        key("2026-11-29T01:00:00")
    assert key("2026-11-29T01:00:00", RunKeyRule(allow_open_period=True)) == "2026-11-29"


def test_an_offset_on_the_rule_is_refused_for_partitioned_runs() -> None:
    """A partition names its own period: RunKeyRule(offset=-1) would shift it a second time."""
    with pytest.raises(ConfigurationError, match="run_offset"):
        key("2026-10-01T01:00:00", RunKeyRule(offset=-1))
    assert key("2026-10-01T01:00:00", RunKeyRule(offset=0)) == "2026-10-01"


# -- segments -------------------------------------------------------------------------------


def test_composite_keys_keep_every_segment() -> None:
    """ProductMapper keys keep their label segments; the time segment becomes the period."""
    assert key("eu|2026-10-01T01:00:00") == "eu|2026-10-01"
    assert key("us|2026-10-01T01:00:00") == "us|2026-10-01"
    assert key("2026-10-01|eu|web") == "2026-10-01|eu|web"
    assert key("eu:2026-10-01", partition_spec=PartitionSpec(delimiter=":")) == "eu|2026-10-01"


def test_fixed_allowed_and_runtime_keys_without_a_time_are_labels() -> None:
    """A FixedKeyMapper's, AllowedKeyMapper's or a run-time key without a time is its own key."""
    resolved = resolve_run_key(RunKeyRule(), facts(partition_key="all_regions"))
    assert resolved.run_key == "all_regions"
    assert "no time segment" in resolved.explanation


@pytest.mark.parametrize(
    ("partition_key", "message"),
    [
        ("", "empty"),
        ("   ", "empty or has leading/trailing blanks"),
        (" eu|2026-10-01", "leading/trailing blanks"),
        ("eu||2026-10-01", "segment 2 '' of 'eu||2026-10-01' is empty"),
        ("eu |2026-10-01", "segment 1 'eu ' of"),
        ("x" * 201, "201 characters long; at most 200"),
        ("eu\x00|2026-10-01", "control"),
        ("2026-13-01", "written like a time but is none"),
        ("eu|2026-02-30T01:00:00", "written like a time but is none"),
        ("2026-10-01|2026-10-02", "2 time segments"),
        ("eu|x|2026-10-01", None),  # fine: two labels and a day
    ],
)
def test_malformed_partition_keys_are_refused_naming_the_rule(
    partition_key: str, message: str | None
) -> None:
    """Empty, blank, too long, control characters, impossible dates, two periods: refused."""
    if message is None:
        assert key(partition_key) == partition_key
        return
    with pytest.raises(InvalidInputError, match=message.replace("|", r"\|")):
        key(partition_key)


def test_a_mapped_tasks_segment_prefixes_the_key() -> None:
    """key_segment gives each mapped instance its own key: segment, then the period."""
    assert key("2026-10-01T01:00:00", key_segment="eu") == "eu|2026-10-01"
    got = resolve_run_key(
        RunKeyRule(offset=-1),
        facts(
            timetable_name="CronTriggerTimetable",
            partitioned=False,
            logical_date=pendulum.datetime(2026, 10, 2, 1, tz="UTC"),
            key_segment="us",
        ),
    )
    assert got.run_key == "us|2026-10-01" and "segment 'us'" in got.explanation
    for bad in ("", " eu", "e|u"):
        with pytest.raises(InvalidRunKeyError):
            key("2026-10-01T01:00:00", key_segment=bad)


# -- one precedence ---------------------------------------------------------------------------


def test_the_partition_wins_over_the_logical_date() -> None:
    """A run with both (a manual run with a logical date and a partition key) takes the
    partition: the logical date of a manual run is the trigger form's pre-filled 'now'."""
    got = resolve_run_key(
        RunKeyRule(),
        facts(run_type="manual", logical_date=NOW, partition_key="2026-10-01T01:00:00"),
    )
    assert (got.run_key, got.source) == ("2026-10-01", "partition_key")


def test_a_conf_run_key_that_agrees_with_the_partition_is_accepted() -> None:
    """An explicit key equal to the partition's is fine, and the log says they agree."""
    got = resolve_run_key(
        RunKeyRule(),
        facts(
            run_type="manual", partition_key="eu|2026-10-01T01:00:00", conf_run_key="eu|2026-10-01"
        ),
    )
    assert got.run_key == "eu|2026-10-01" and "agrees" in got.explanation


def test_a_conf_run_key_that_contradicts_the_partition_is_refused_unless_overridden() -> None:
    """run_key 2026-10-02 on the partition of 2026-10-01: refused naming both and the switch;
    with run_key_overrides_partition the explicit key wins and the log says so."""
    contradicting = facts(
        run_type="manual", partition_key="2026-10-01T01:00:00", params_run_key="2026-10-02"
    )
    with pytest.raises(RunKeyConflictError, match="run_key_overrides_partition") as refused:
        resolve_run_key(RunKeyRule(), contradicting)
    assert "'2026-10-02'" in str(refused.value) and "'2026-10-01'" in str(refused.value)
    overridden = resolve_run_key(
        RunKeyRule(),
        facts(
            run_type="manual",
            partition_key="2026-10-01T01:00:00",
            params_run_key="2026-10-02",
            override_partition=True,
        ),
    )
    assert (overridden.run_key, overridden.source) == ("2026-10-02", "params")
    assert "overriding the run's partition_key" in overridden.explanation


def test_backfill_and_asset_runs_never_take_an_explicit_key() -> None:
    """A run_key in a partitioned backfill's or an asset-triggered run's conf is refused."""
    for run_type in ("backfill", "asset_triggered", "scheduled"):
        with pytest.raises(InvalidRunKeyError, match="only manual runs"):
            resolve_run_key(
                RunKeyRule(),
                facts(run_type=run_type, partition_key="2026-10-01", conf_run_key="2026-10-01"),
            )


def test_a_callable_rule_decides_and_sees_the_partition() -> None:
    """A callable run_key_rule is called for partitioned runs too, with the context."""
    got = resolve_run_key(
        lambda context: f"custom-{context['partition_key']}",
        facts(partition_key="eu", context={"partition_key": "eu"}),
    )
    assert (got.run_key, got.source) == ("custom-eu", "callable")


def test_a_partitioned_run_without_any_key_names_the_partition_key() -> None:
    """A manual run of a partitioned DAG without a partition key or run_key is refused with
    a message that names the partition key field, even with a logical date (the trigger
    form pre-fills it with now)."""
    with pytest.raises(RunKeyMissingError, match="Partition Key field") as refused:
        resolve_run_key(RunKeyRule(), facts(run_type="manual"))
    # ... and how to run one period by hand, airflow dags test included (it sets no key).
    assert 'airflow dags test DAG_ID -c \'{"run_key": "2026-10-01"}\'' in str(refused.value)
    with pytest.raises(RunKeyMissingError, match="partitioned DAG"):
        resolve_run_key(RunKeyRule(), facts(run_type="manual", logical_date=NOW))
    with pytest.raises(RunKeyMissingError) as plain:
        resolve_run_key(RunKeyRule(), facts(run_type="manual", partitioned=False))
    assert "partition" not in str(plain.value)


@pytest.mark.parametrize(
    ("explicit", "ok"),
    [("eu|2026-10-01", True), ("2026-10-01|eu", True), ("eu|us", False), ("eu|2026-13-01", False)],
)
def test_explicit_keys_may_carry_label_segments(explicit: str, ok: bool) -> None:
    """A typed run_key may name a segment (eu|2026-10-01) but must hold one real period."""
    run = facts(run_type="manual", partitioned=False, conf_run_key=explicit)
    if ok:
        assert resolve_run_key(RunKeyRule(), run).run_key == explicit
    else:
        with pytest.raises(InvalidRunKeyError):
            resolve_run_key(RunKeyRule(), run)


# -- reading keys back --------------------------------------------------------------------------


def test_key_parts_and_segment_templates() -> None:
    """A key splits into its period and its labels; a segment pattern rebuilds its keys."""
    parts = key_parts("eu|2026-10-01")
    assert (parts.period, parts.segment) == ("2026-10-01", "eu|*")
    assert parts.with_period("2026-10-02") == "eu|2026-10-02"
    assert key_parts("2026-W40").segment == "" and key_parts("all").period is None
    assert segment_template("eu").with_period("2026-10-03") == "eu|2026-10-03"
    assert segment_template("*|web").with_period("2026-10") == "2026-10|web"
    assert segment_template("").with_period(dt.date(2026, 10, 1).isoformat()) == "2026-10-01"
    with pytest.raises(InvalidInputError):
        segment_template("*|*")
