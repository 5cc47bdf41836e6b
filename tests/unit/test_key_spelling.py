"""One spelling per run key (issue 31): whatever text names a period, a partition or a
segment resolves to one canonical key or is refused (no database, no Airflow)."""

from __future__ import annotations

import datetime as dt
import unicodedata
from typing import Any

import pendulum
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from airflow_idempotency.exceptions import InvalidInputError, InvalidRunKeyError
from airflow_idempotency.key_spelling import (
    check_key_text,
    check_text,
    folded,
    key_parts,
    reads_as_time,
    segment_template,
)
from airflow_idempotency.partitions import PartitionSpec
from airflow_idempotency.run_key import RunFacts, RunKeyRule, resolve_run_key

NOW = pendulum.datetime(2026, 11, 29, 8, 0, tz="UTC")
PERIODS = ("hour", "day", "week", "month")
DIGITS = {
    name: "".join(chr(zero + n) for n in range(10))
    for name, zero in [
        ("ascii", 0x30),
        ("fullwidth", 0xFF10),
        ("arabic-indic", 0x660),
        ("devanagari", 0x966),
    ]
}
LIMITED = settings(max_examples=300, deadline=None, derandomize=True)


def spelled(text: str, digits: str) -> str:
    return text.translate(str.maketrans("0123456789", DIGITS[digits]))


def facts(**overrides: Any) -> RunFacts:
    args: dict[str, Any] = {
        "run_type": "manual",
        "timezone": "Europe/Amsterdam",
        "now": NOW,
        "timetable_name": "CronTriggerTimetable",
    }
    args.update(overrides)
    return RunFacts(**args)


def explicit(rule: RunKeyRule, key: object) -> str:
    return resolve_run_key(rule, facts(conf_run_key=key)).run_key


def assert_canonical(key: str, *, free_text: bool = False) -> None:
    """``key`` passes every check and its period segment is its period's one spelling; its
    labels read as no period or time (``free_text``, a callable's: as at most one time)."""
    assert check_key_text(key) == key
    assert unicodedata.normalize("NFC", key) == key
    parts = key_parts(key)
    labels = [s for s in parts.template if s != "{}"]
    times = [label for label in labels if reads_as_time(folded(label))]
    assert len(times) <= (1 if free_text and parts.period is None else 0)
    for label in labels:
        assert folded(label) == label or not reads_as_time(folded(label))
        assert label not in ("*", "{}")
    if parts.period is not None:
        rule = RunKeyRule.for_key(parts.period)
        start, _ = rule.period_bounds(parts.period, "Europe/Amsterdam")
        assert rule.key_for(start, "Europe/Amsterdam", 0) == parts.period


# -- the defects of issue 31, one by one ------------------------------------------------------


@pytest.mark.parametrize("digits", ["fullwidth", "arabic-indic", "devanagari"])
def test_a_period_in_other_digits_is_refused_naming_its_spelling(digits: str) -> None:
    """2026-10-01 in fullwidth digits (what an input method types), Arabic-Indic or
    Devanagari ones: refused, and the message names 2026-10-01; as a label or a partition
    segment too."""
    for period, key in [("day", "2026-10-01"), ("month", "2026-10"), ("hour", "2026-10-01T13Z")]:
        with pytest.raises(InvalidRunKeyError, match=f"one spelling is '{key}'"):
            explicit(RunKeyRule(period=period), spelled(key, digits))  # type: ignore[arg-type]
    with pytest.raises(InvalidRunKeyError, match="one spelling is '2026-10-01'"):
        explicit(RunKeyRule(), f"eu|{spelled('2026-10-01', digits)}")
    with pytest.raises(InvalidRunKeyError, match="one spelling is '2026-10-01"):
        resolve_run_key(
            RunKeyRule(),
            facts(run_type="scheduled", partition_key=spelled("2026-10-01T01:00:00", digits)),
        )
    with pytest.raises(InvalidRunKeyError, match="one spelling is '2026-10-01'"):
        check_key_text(spelled("2026-10-01", digits))  # a callable's or a script's key


@pytest.mark.parametrize(
    "invisible",
    [
        "\u200b",
        "\u200e",
        "\u200f",
        "\u202e",
        "\u2066",
        "\ufeff",
        "\u00ad",
        "\u00a0",
        "\ufe0f",
        "\u034f",
        "\u3164",
    ],
)
def test_invisible_characters_are_refused_in_labels_and_callable_keys(invisible: str) -> None:
    """Zero-width space, bidi marks and overrides, BOM, soft hyphen, no-break space: a key
    that looks like another is refused wherever it comes from."""
    for text in (f"e{invisible}u", f"eu{invisible}"):
        with pytest.raises(InvalidInputError, match=r"U\+|blanks"):
            check_text(text, "job name")
        with pytest.raises(InvalidInputError, match=r"U\+|blanks"):
            explicit(RunKeyRule(), f"{text}|2026-10-01")
        with pytest.raises(InvalidInputError, match=r"U\+|blanks"):
            resolve_run_key(lambda context, text=text: f"{text}|2026-10-01", facts())  # type: ignore[misc]
        with pytest.raises(InvalidInputError, match=r"U\+|blanks"):
            resolve_run_key(
                RunKeyRule(), facts(run_type="scheduled", partition_key=f"{text}|2026-10-01")
            )


def test_a_key_or_label_starting_with_a_combining_mark_is_refused() -> None:
    """A lone combining acute would be drawn on the delimiter before it: refused."""
    with pytest.raises(InvalidInputError, match="combining mark"):
        explicit(RunKeyRule(), "eu|\u0301|2026-10-01")
    with pytest.raises(InvalidInputError, match="combining mark"):
        check_text("\u0301job", "job name")


def test_non_nfc_text_is_read_in_nfc_and_said_so() -> None:
    """e + combining acute (NFD) and é (NFC) are one key; the log says the text was mapped;
    check_text (job names, a script's keys) refuses the NFD form naming the NFC one."""
    nfd, nfc = "cafe\u0301", "caf\u00e9"
    for resolved in (
        resolve_run_key(RunKeyRule(), facts(conf_run_key=f"{nfd}|2026-10-01")),
        resolve_run_key(
            RunKeyRule(), facts(run_type="scheduled", partition_key=f"{nfd}|2026-10-01")
        ),
        resolve_run_key(lambda context: f"{nfd}|2026-10-01", facts()),
    ):
        assert resolved.run_key == f"{nfc}|2026-10-01"
        assert "NFC" in resolved.explanation
    with pytest.raises(InvalidInputError, match=f"is written '{nfc}'"):
        check_text(nfd, "job name")


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("2026-10|2026-10-01", "reads as a period"),
        ("2026-W40|2026-10-01", "reads as a period"),
        ("2026-10-01T01:00:00|2026-10-01", "reads as a period"),
        ("*|2026-10-01", "marks the period's place"),
        ("\uff0a|2026-10-01", "marks the period's place"),
        ("{}|2026-10-01", "marks the period's place"),
        ("eu\uff5cus|2026-10-01", "written like it"),
    ],
)
def test_labels_that_read_as_a_period_or_a_marker_are_refused(key: str, message: str) -> None:
    """A label shaped like a period would be filed under it by gaps and the calendar; a
    label '*' is the CLI's period marker: refused, explicit or from a partition."""
    with pytest.raises(InvalidRunKeyError, match=message):
        explicit(RunKeyRule(), key)
    with pytest.raises(InvalidRunKeyError):
        resolve_run_key(RunKeyRule(), facts(run_type="scheduled", partition_key=key))


@pytest.mark.parametrize(
    ("period", "typed", "canonical"),
    [
        ("day", "2026-10-1", "2026-10-01"),
        ("day", "2026/10/01", "2026-10-01"),
        ("day", "20261001", "2026-10-01"),
        ("week", "2026-w40", "2026-W40"),
        ("hour", "2026-10-01T13:00Z", "2026-10-01T13Z"),
        ("hour", "2026-10-01t13z", "2026-10-01T13Z"),
        ("month", "2026-1", "2026-01"),
    ],
)
def test_a_period_written_another_way_is_refused_naming_its_spelling(
    period: str, typed: str, canonical: str
) -> None:
    """A near miss is refused with the one spelling named; as a label it is no name either."""
    with pytest.raises(InvalidRunKeyError, match=f"one spelling is '{canonical}'"):
        explicit(RunKeyRule(period=period), typed)  # type: ignore[arg-type]
    if not typed.isdigit():
        with pytest.raises(InvalidRunKeyError, match=f"reads as the period '{canonical}'"):
            resolve_run_key(RunKeyRule(), facts(run_type="scheduled", partition_key=f"eu|{typed}"))
    else:  # a number may be a label (a store id): kept
        assert explicit(RunKeyRule(), f"{typed}|2026-10-01") == f"{typed}|2026-10-01"


def test_callable_keys_have_one_period_and_no_marker() -> None:
    """A callable's key may be any text, but not two periods, a marker or foreign digits."""
    assert resolve_run_key(lambda c: "batch-7", facts()).run_key == "batch-7"
    for bad in ("2026-10|2026-10-01", "*", "eu|*", "{}"):
        with pytest.raises(InvalidRunKeyError):
            resolve_run_key(lambda c, bad=bad: bad, facts())  # type: ignore[misc]


def test_a_mapped_task_takes_the_period_only() -> None:
    """With key_segment 'eu', run_key 'eu|2026-10-01' would make 'eu|eu|2026-10-01':
    refused, naming the period to give."""
    with pytest.raises(InvalidRunKeyError, match="'2026-10-01'"):
        resolve_run_key(RunKeyRule(), facts(conf_run_key="eu|2026-10-01", key_segment="eu"))
    got = resolve_run_key(RunKeyRule(), facts(conf_run_key="2026-10-01", key_segment="eu"))
    assert got.run_key == "eu|2026-10-01"


def test_segment_patterns_refuse_labels_that_read_as_periods() -> None:
    """gaps --segment '2026-10|*' cannot name a segment: refused like the key it would read."""
    with pytest.raises(InvalidInputError):
        segment_template("2026-10|*")
    assert segment_template("eu").with_period("2026-10-01") == "eu|2026-10-01"


@pytest.mark.parametrize(
    "typed",
    [
        "2026-10-01 00:00:00",  # str(datetime), a date picker's text
        "2026-10-01T00:00",  # the seconds left out
        "2026-10-01T00:00:00.000",
        "2026-10-01 00:00:00+00:00",
        "2026-10-01Z",
        "2026\u201310\u201301",  # en dashes, what a word processor makes of hyphens
        "2026\u221210\u221201",  # minus signs
    ],
)
def test_a_day_typed_with_a_time_is_no_label_and_no_second_key(typed: str) -> None:
    """A partition key typed by hand as 2026-10-01 00:00:00 (or without seconds, with an en
    dash) on a daily partitioned DAG became the run key '2026-10-01 00:00:00', a second key
    of the day the scheduled partition 2026-10-01T00:00:00 keys '2026-10-01': the day done
    twice (adversary, issue 31). Refused, naming the day, as a key and as a label."""
    spec = PartitionSpec(time_formats=("%Y-%m-%dT%H:%M:%S",), timezone="UTC")
    scheduled = facts(
        run_type="scheduled", partition_key="2026-10-01T00:00:00", partition_spec=spec
    )
    assert resolve_run_key(RunKeyRule(), scheduled).run_key == "2026-10-01"
    for key in (typed, f"eu|{typed}"):
        by_hand = facts(partition_key=key, partitioned=True, partition_spec=spec)
        with pytest.raises(InvalidRunKeyError, match=r"'2026-10-01(T00Z)?'"):
            resolve_run_key(RunKeyRule(), by_hand)
    with pytest.raises(InvalidRunKeyError, match=r"'2026-10-01(T00Z)?'"):
        explicit(RunKeyRule(), f"{typed}|2026-10-01")


@pytest.mark.parametrize(
    ("typed", "canonical"),
    [
        ("\uff12\uff10\uff12\uff16-\uff11\uff10-\uff10\uff11", "2026-10-01"),
        ("2026-10-1", "2026-10-01"),
        ("2026-w40", "2026-W40"),
    ],
)
def test_a_range_bound_of_gaps_written_another_way_names_its_spelling(
    typed: str, canonical: str
) -> None:
    """`gaps --from` in fullwidth digits said only 'is not a run key of any period'
    (adversary, issue 31): the refusal names the one spelling, as every other does."""
    with pytest.raises(InvalidRunKeyError, match=f"one spelling is '{canonical}'"):
        RunKeyRule.for_key(typed)


# -- properties --------------------------------------------------------------------------------


def _period_texts() -> st.SearchStrategy[str]:
    days = st.dates(dt.date(1990, 1, 1), dt.date(2026, 10, 31))
    return st.one_of(
        days.map(dt.date.isoformat),
        days.map(lambda d: f"{d:%Y-%m}"),
        days.map(lambda d: "{:04d}-W{:02d}".format(*d.isocalendar()[:2])),
        st.tuples(days, st.integers(0, 23)).map(lambda t: f"{t[0].isoformat()}T{t[1]:02d}Z"),
        st.tuples(days, st.integers(0, 23)).map(lambda t: f"{t[0].isoformat()}T{t[1]:02d}:00:00"),
    )


_PIECES = st.one_of(
    st.tuples(_period_texts(), st.sampled_from(sorted(DIGITS))).map(lambda t: spelled(*t)),
    st.text(max_size=6),
    st.sampled_from(
        [
            "eu",
            "us",
            "*",
            "\uff0a",
            "{}",
            "|",
            "\uff5c",
            " ",
            "\u200b",
            "\u202e",
            "\u00a0",
            "e\u0301",
            "\u00e9",
            "2026-13-01",
            "2026-02-30",
            "-",
            "T",
            "Z",
            "W",
        ]
    ),
)
KEY_TEXTS = st.lists(_PIECES, min_size=1, max_size=4).flatmap(
    lambda pieces: st.sampled_from(["|", "", " "]).map(lambda sep: sep.join(pieces))
)


@LIMITED
@given(text=KEY_TEXTS, period=st.sampled_from(PERIODS))
@example(text="\uff12\uff10\uff12\uff16-\uff11\uff10-\uff10\uff11", period="day")
@example(text="2026-10|2026-10-01", period="day")
@example(text="e\u0301u|2026-10-01", period="day")
def test_any_explicit_key_resolves_to_a_canonical_fixed_point_or_is_refused(
    text: str, period: str
) -> None:
    """Any typed run_key is refused, or resolves to k that resolves to itself and whose
    period is written in its one spelling."""
    rule = RunKeyRule(period=period)  # type: ignore[arg-type]
    try:
        key = explicit(rule, text)
    except InvalidInputError:
        return
    assert explicit(rule, key) == key
    assert_canonical(key)


@LIMITED
@given(text=KEY_TEXTS, period=st.sampled_from(PERIODS))
def test_any_partition_key_resolves_to_a_canonical_key_or_is_refused(
    text: str, period: str
) -> None:
    """Any partition key is refused, or its run key is canonical, and the same key given
    explicitly (or as the partition key again) resolves to itself."""
    rule = RunKeyRule(period=period)  # type: ignore[arg-type]
    try:
        key = resolve_run_key(rule, facts(run_type="scheduled", partition_key=text)).run_key
    except InvalidInputError:
        return
    assert_canonical(key)
    assert resolve_run_key(rule, facts(run_type="scheduled", partition_key=key)).run_key == key
    if key_parts(key).period is not None:
        assert explicit(rule, key) == key


@LIMITED
@given(text=KEY_TEXTS)
def test_any_callable_key_is_canonical_or_refused(text: str) -> None:
    """Whatever a run_key_rule function returns is refused or kept as one canonical key."""
    try:
        key = resolve_run_key(lambda context: text, facts()).run_key
    except InvalidInputError:
        return
    assert_canonical(key, free_text=True)
    assert resolve_run_key(lambda context: key, facts()).run_key == key


@LIMITED
@given(
    day=st.dates(dt.date(2000, 1, 1), dt.date(2026, 10, 31)),
    hour=st.integers(0, 23),
    label=st.sampled_from(["", "eu|", "caf\u00e9|", "cafe\u0301|"]),
)
def test_every_spelling_of_one_day_resolves_to_one_key(day: dt.date, hour: int, label: str) -> None:
    """A day typed as text or a date, or a partition of any hour of it in the timetable's
    formats, resolves to one key; an NFD label is the NFC one."""
    rule = RunKeyRule()
    spellings = [
        explicit(rule, f"{label}{day.isoformat()}"),
        resolve_run_key(rule, facts(run_type="scheduled", partition_key=f"{label}{day}")).run_key,
    ]
    if not label:
        spellings.append(explicit(rule, day))
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H", "%Y%m%d"):
        moment = dt.datetime.combine(day, dt.time(hour)).strftime(fmt)
        spec = PartitionSpec(time_formats=(fmt,), timezone="Europe/Amsterdam")
        spellings.append(
            resolve_run_key(
                rule,
                facts(run_type="scheduled", partition_key=f"{label}{moment}", partition_spec=spec),
            ).run_key
        )
    assert len(set(spellings)) == 1
    assert spellings[0] == f"{unicodedata.normalize('NFC', label)}{day.isoformat()}"


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_a_key_checked_again_gets_the_same_verdict(key: str) -> None:
    """check_key_text remembers the keys it accepted (issue 32, goal 4): a second check of any
    text gives the first one's verdict, a refusal with the same words."""

    def verdict() -> tuple[str, str]:
        try:
            return ("accepted", check_key_text(key, "run key"))
        except InvalidInputError as exc:
            return (type(exc).__name__, str(exc))

    first = verdict()
    assert verdict() == first
    if first[0] == "accepted":
        assert first[1] == key
