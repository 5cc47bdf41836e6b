"""Run keys: the name of the business period a run is for.

A run key is explicit text such as ``2026-10-01`` or, for a segment of the work,
``eu|2026-10-01``. It is decided here and nowhere else (:func:`resolve_run_key`), from the
facts the operator reads from Airflow (:class:`RunFacts`), in one order of precedence:

1. an explicit ``run_key`` in the run's conf (then its params): manual runs only. When the
   run also has a ``partition_key``, the explicit key must be the one the partition gives;
   a contradicting one is refused unless the conf also says
   ``"run_key_overrides_partition": true``;
2. a callable ``run_key_rule`` (it gets the task context, ``partition_key`` included);
3. the run's ``partition_key`` (Airflow 3.2+ partitioned runs: scheduled, backfilled,
   triggered with a key, or asset-triggered through a partition mapper);
4. the run's logical date, through the :class:`RunKeyRule` (not for a partitioned DAG:
   its periods are its partitions);
5. none of these: refused, naming what to give. Nothing here ever falls back to "now".

A mapped task whose segment comes from data (``key_segment``) prefixes the key so decided
with its segment: ``eu|2026-10-01``.

How a rule maps a run (``offset=None`` picks the offset from the DAG's timetable, so one
DAG file keys one run the same way on Airflow 2.11 and 3.x):

=================================================  ===============  ===========================
timetable                                          logical date     run key (period="day")
=================================================  ===============  ===========================
``CronTriggerTimetable``: a cron string on         the fire time    day BEFORE, offset -1
Airflow 3 (its default), or given explicitly       D+1 01:00        -> D
``CronDataIntervalTimetable``: a cron string on    interval start   the interval's day, offset 0
Airflow 2 (its default), or given explicitly       D 01:00          -> D
``schedule=timedelta(days=1)``                     interval start   the interval's day, offset 0
(DeltaDataIntervalTimetable)
``schedule=None`` / assets (manual logical date)   as given         that day, offset 0
=================================================  ===============  ===========================

The logical date is converted to the DAG's timezone before the day is taken, so a DAG in
Europe/Amsterdam firing at 00:30 local time (22:30 or 23:30 UTC the day before) maps to
the local calendar day. Hourly keys are in UTC (``2026-10-25T01Z``) because a local hour
repeats when daylight saving time ends.
"""

from __future__ import annotations

import datetime as dt
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import pendulum

from airflow_idempotency.exceptions import (
    ConfigurationError,
    InvalidRunKeyError,
    RunKeyConflictError,
    RunKeyMissingError,
)
from airflow_idempotency.key_spelling import MAX_KEY_LENGTH as MAX_KEY_LENGTH
from airflow_idempotency.key_spelling import (
    PERIOD_FORMATS,
    check_key_text,
    check_label,
)
from airflow_idempotency.key_spelling import KeyParts as KeyParts
from airflow_idempotency.key_spelling import check_text as check_text
from airflow_idempotency.key_spelling import key_parts as key_parts
from airflow_idempotency.key_spelling import segment_template as segment_template
from airflow_idempotency.partitions import (
    DEFAULT_TIME_FORMATS,
    SEGMENT_DELIMITER,
    PartitionSpec,
    TimeSegment,
    parse_time_segment,
)
from airflow_idempotency.run_key_rule import MAX_OFFSET as MAX_OFFSET
from airflow_idempotency.run_key_rule import Period as Period
from airflow_idempotency.run_key_rule import RunKeyRule as RunKeyRule

_FORMATS = PERIOD_FORMATS


RunKeyCallable = Callable[[Any], str]
"""A custom rule: takes the Airflow task context, returns the run key (free text)."""

_MANUAL_RUN_TYPES = frozenset({"manual", "operator_triggered"})
OVERRIDE_FLAG = "run_key_overrides_partition"
"""The conf switch that lets an explicit ``run_key`` differ from the run's partition."""


@dataclass(frozen=True)
class RunFacts:
    """What :func:`resolve_run_key` reads about one task execution, taken from Airflow's
    context by the operator (and built by hand by ``explain`` and ``plan``).

    :param run_type: ``manual``, ``scheduled``, ``backfill``, ``asset_triggered``, ...
    :param timezone: the DAG's timezone (the day of a logical date is taken there).
    :param now: the current time: a key whose period has not ended is refused.
    :param timetable_name: the class name of the DAG's timetable (picks the default offset).
    :param logical_date: the run's logical date; ``None`` for partitioned runs and manual
        runs without one.
    :param partition_key: the run's Airflow partition key (3.2+), ``None`` if it has none.
    :param partition_date: the run's partition date, for the log only (the key decides).
    :param partitioned: the DAG's timetable makes partitioned runs (for error messages).
    :param partition_spec: how the DAG writes its partition keys.
    :param conf_run_key: ``run_key`` in the run's conf (``None``/``""``: not given).
    :param params_run_key: ``run_key`` in the run's params.
    :param override_partition: the conf set ``run_key_overrides_partition``.
    :param key_segment: a mapped task's own segment (``eu``), prefixed to the key.
    :param context: the Airflow task context, for a callable rule.
    """

    run_type: str
    timezone: str
    now: dt.datetime
    timetable_name: str | None = None
    logical_date: dt.datetime | None = None
    partition_key: str | None = None
    partition_date: dt.datetime | None = None
    partitioned: bool = False
    partition_spec: PartitionSpec = PartitionSpec()
    conf_run_key: object = None
    params_run_key: object = None
    override_partition: bool = False
    key_segment: str | None = None
    context: Any = None


Source = Literal["conf", "params", "partition_key", "logical_date", "callable"]


@dataclass(frozen=True)
class ResolvedRunKey:
    """A run key and a sentence saying where it came from, for the task log."""

    run_key: str
    source: Source
    explanation: str
    zone: str | None = None  # the zone the key's period was read in (the zone rule)


def resolve_run_key(rule: RunKeyRule | RunKeyCallable, facts: RunFacts) -> ResolvedRunKey:
    """Decide the run key of one task execution, or raise :class:`InvalidRunKeyError`.

    The one place that decides, in the order of the module docstring. Scheduled, backfill
    and asset-triggered runs never take an explicit key: a run_key in a backfill's conf
    would map every date onto one key, so it is refused. An explicit key for a callable
    rule is free text, checked like any key but not parsed as a period. Every key has one
    spelling (:mod:`airflow_idempotency.key_spelling`): text read in another Unicode form
    than NFC is mapped to NFC and the explanation says so; any other spelling is refused.
    """
    facts, mapped = _in_nfc(facts)
    # The zone of the keys: the rule's, else a partitioned DAG's timetable's, else the DAG's.
    pinned = rule.timezone if isinstance(rule, RunKeyRule) else None
    zone = pinned or facts.partition_spec.timezone or facts.timezone
    if zone != facts.timezone:
        facts = replace(facts, timezone=zone)
    resolved = _resolve_base(rule, facts)
    if facts.key_segment is not None:
        resolved = _with_segment(resolved, facts.key_segment)
    if mapped:
        note = f"; read in Unicode NFC: {', '.join(mapped)} (the same text, composed)"
        resolved = replace(resolved, explanation=resolved.explanation + note)
    return resolved


def _in_nfc(facts: RunFacts) -> tuple[RunFacts, list[str]]:
    """``facts`` with its texts in NFC, and which were not."""
    changes: dict[str, Any] = {}
    for name in ("conf_run_key", "params_run_key", "partition_key", "key_segment"):
        value = getattr(facts, name)
        if isinstance(value, str) and unicodedata.normalize("NFC", value) != value:
            changes[name] = unicodedata.normalize("NFC", value)
    mapped = [
        f"{name.replace('_run_key', ' run_key')} as {text!r}" for name, text in changes.items()
    ]
    return (replace(facts, **changes) if changes else facts), mapped


def _with_segment(resolved: ResolvedRunKey, key_segment: str) -> ResolvedRunKey:
    """The key of a mapped task's segment: its segment, then the key decided for the run."""
    segment = check_label(key_segment, "key_segment", key_segment)
    if resolved.source in ("conf", "params") and SEGMENT_DELIMITER in resolved.run_key:
        raise InvalidRunKeyError(
            f"run_key {resolved.run_key!r} has segments, but this task writes its own segment "
            f"{segment!r} before the key: give run_key the period only (e.g. "
            f"{resolved.run_key.split(SEGMENT_DELIMITER)[-1]!r}), each mapped task adds its segment"
        )
    key = check_key_text(f"{segment}{SEGMENT_DELIMITER}{resolved.run_key}", "run key")
    explanation = f"run_key {key!r}: this task's segment {segment!r} before {resolved.explanation}"
    return replace(resolved, run_key=key, explanation=explanation)


def _from_callable(rule: RunKeyCallable, facts: RunFacts) -> ResolvedRunKey:
    value = rule(facts.context)
    note = ""
    if isinstance(value, str) and unicodedata.normalize("NFC", value) != value:
        value = unicodedata.normalize("NFC", value)
        note = " (its text read in Unicode NFC)"
    key = check_key_text(value, "run key from run_key_rule")
    return ResolvedRunKey(key, "callable", f"run_key {key!r} from the DAG's run_key_rule{note}")


def _resolve_base(rule: RunKeyRule | RunKeyCallable, facts: RunFacts) -> ResolvedRunKey:
    source: Literal["conf", "params"] = "conf" if facts.conf_run_key not in (None, "") else "params"
    explicit = facts.conf_run_key if source == "conf" else facts.params_run_key
    if explicit not in (None, ""):
        return _explicit(rule, facts, explicit, source)
    if not isinstance(rule, RunKeyRule):
        return _from_callable(rule, facts)
    if facts.partition_key is not None:
        return partition_run_key(rule, facts)
    # A partitioned DAG's periods are its partitions: a run without one (the trigger form
    # with its partition key left empty, its logical date pre-filled with now) names none.
    if facts.logical_date is None or facts.partitioned:
        raise RunKeyMissingError(_missing_message(rule, facts))
    return _from_logical_date(rule, facts, facts.logical_date)


def _explicit(
    rule: RunKeyRule | RunKeyCallable,
    facts: RunFacts,
    explicit: object,
    source: Literal["conf", "params"],
) -> ResolvedRunKey:
    if facts.run_type not in _MANUAL_RUN_TYPES:
        raise InvalidRunKeyError(
            f"run_key {explicit!r} was given to a {facts.run_type} run; only manual runs take "
            "an explicit run_key. Remove it from the conf: backfill and scheduled runs derive "
            "the run key from each run's partition or logical date."
        )
    if not isinstance(rule, RunKeyRule):
        key = check_key_text(explicit, "run_key")
    else:
        key = _explicit_period_key(rule, explicit, facts.timezone, facts.now)
    explanation = f"run_key {key!r} given explicitly in the run's {source}"
    if not isinstance(rule, RunKeyRule):
        return ResolvedRunKey(key, source, explanation)
    zone = rule.zone_of_keys(facts.timezone)
    if facts.partition_key is None:
        return ResolvedRunKey(key, source, explanation, zone)
    if facts.override_partition:
        return ResolvedRunKey(
            key,
            source,
            f"{explanation}, overriding the run's partition_key {facts.partition_key!r} "
            f"({OVERRIDE_FLAG} is set)",
            zone,
        )
    from_partition = partition_run_key(rule, facts)
    if from_partition.run_key != key:
        raise RunKeyConflictError(
            f"run_key {key!r} in the run's {source} contradicts the run's partition_key "
            f"{facts.partition_key!r}, whose run key is {from_partition.run_key!r}. Nothing was "
            f"done. Leave run_key empty to process the partition, trigger with partition_key "
            f"set to the period you mean, or, to process {key!r} in this run anyway, add "
            f'"{OVERRIDE_FLAG}": true to the conf.'
        )
    agreed = f"{explanation}; it agrees with the run's partition_key"
    return ResolvedRunKey(key, source, agreed, zone)


def _missing_message(rule: RunKeyRule, facts: RunFacts) -> str:
    example = rule.format_hint.rsplit("e.g. ", 1)[-1]  # a key of the rule's period
    if facts.partitioned:
        return (
            f"this {facts.run_type} run of a partitioned DAG has no partition_key and no "
            f"run_key, so it does not say which partition to process (a partitioned DAG's "
            f"runs are keyed by their partition, not by a logical date). Trigger it with a "
            f'partition key: the trigger form\'s Partition Key field, "partition_key" in the '
            f"REST body, or airflow backfill create over partition dates. To run one period "
            f"by hand (airflow dags test included, which sets no partition key), give its run "
            f"key in the conf, in the format {rule.format_hint}: airflow dags test DAG_ID -c "
            f'\'{{"run_key": "{example}"}}\'.'
        )
    return (
        f"this {facts.run_type} run has no logical date and no run_key, so it does not say "
        f"which business period to process. Trigger it again with run_key in the conf, in "
        f"the format {rule.format_hint} (for example: airflow dags trigger DAG_ID -c "
        f'\'{{"run_key": "{example}"}}\', or fill in the run_key field of the trigger form).'
    )


def _from_logical_date(
    rule: RunKeyRule, facts: RunFacts, logical_date: dt.datetime
) -> ResolvedRunKey:
    timezone = facts.timezone
    offset = rule.effective_offset(facts.timetable_name)
    key = rule.key_for(logical_date, timezone, offset)
    rule.check_ended(key, timezone, facts.now)
    local = pendulum.instance(logical_date).in_timezone(timezone).to_iso8601_string()
    explanation = (
        f"run_key {key!r} derived from the logical date {local} ({timezone}) with offset "
        f"{offset} {rule.period}(s) for timetable {facts.timetable_name or 'unknown'}"
    )
    if facts.run_type in _MANUAL_RUN_TYPES:
        explanation = (
            f"NOTE: this manual run has no explicit run_key, so {explanation}. If that is not "
            f"the business period you meant, trigger again with run_key set."
        )
    return ResolvedRunKey(key, "logical_date", explanation, rule.zone_of_keys(timezone))


def partition_run_key(rule: RunKeyRule, facts: RunFacts) -> ResolvedRunKey:
    """The run key of the run's ``partition_key``: its segments in order, joined by ``|``,
    the one time segment written as the rule's period (``eu|2026-10-01T01:00:00`` ->
    ``eu|2026-10-01``), the other segments kept as they are.

    The time segment is taken at the run's exact ``partition_date`` when it reads as the
    segment's wall-clock time: Airflow writes both 02:00 hours of an autumn night in
    Europe/Amsterdam as ``2026-10-25T02:00:00``, and their partition dates (00:00 and 01:00
    UTC) make them the hours ``2026-10-25T00Z`` and ``2026-10-25T01Z``.

    Refused (nothing written): an empty, blank-padded, overlong or control-character key; an
    empty or blank-padded segment, a ``|`` inside a segment of another delimiter; a label
    that reads as a period; more than one time segment; a time segment of a longer period
    than the rule's (``2026-10`` for a daily job); for an hourly job, a wall-clock hour that
    happens twice with no partition date to say which, or never happens (the spring gap); a
    period that has not ended (unless ``allow_open_period``); an explicit ``offset`` on the
    rule (a partition names its own period: use the timetable's ``run_offset``).
    """
    key = check_text(facts.partition_key, "partition_key")
    if rule.offset not in (None, 0):
        raise ConfigurationError(
            f"RunKeyRule(offset={rule.offset}) moves keys derived from logical dates, but this "
            f"run is keyed by its partition_key {key!r}, which names its period itself. Remove "
            f"the offset; to move the partition, give CronPartitionTimetable a run_offset "
            f"(run_offset=-1: the run at D+1 01:00 is for day D)."
        )
    spec = facts.partition_spec
    timezone = facts.timezone  # the keys' zone (resolve_run_key): the timetable's if known
    segments = key.split(spec.delimiter)
    out, times = _partition_segments(segments, spec, spec.timezone or timezone, key)
    how = "no time segment: the key is the same work whenever it runs again"
    zone = rule.zone_of_keys(timezone) if times else None
    if times:
        index, parsed = times[0]
        parsed, note = _instant_of(rule, parsed, key, facts.partition_date)
        period_key = _period_of(rule, parsed, key, timezone, facts.now)
        out[index - 1] = period_key
        where = f"segment {index} " if len(segments) > 1 else ""
        how = (
            f"{where}{parsed.text!r} is the {rule.period} {period_key} in {timezone}{note}"
            if parsed.text != period_key
            else f"{where}{parsed.text!r} is a {rule.period}"
        )
    run_key = check_key_text(SEGMENT_DELIMITER.join(out), "run key from partition_key")
    return ResolvedRunKey(
        run_key,
        "partition_key",
        f"run_key {run_key!r} from the run's partition_key {key!r} ({how})",
        zone,
    )


def _partition_segments(
    segments: list[str], spec: PartitionSpec, timezone: str, key: str
) -> tuple[list[str], list[tuple[int, TimeSegment]]]:
    """The segments with labels checked, and the time segments parsed (at most one)."""
    formats = (*spec.time_formats, *DEFAULT_TIME_FORMATS)
    out: list[str] = []
    times: list[tuple[int, TimeSegment]] = []
    for index, segment in enumerate(segments, start=1):
        parsed = parse_time_segment(segment, formats, timezone)
        if parsed is None:
            out.append(check_label(segment, f"segment {index}", key))
        else:
            times.append((index, parsed))
            out.append(segment)
    if len(times) > 1:
        raise InvalidRunKeyError(
            f"partition_key {key!r} has {len(times)} time segments "
            f"({', '.join(repr(t.text) for _, t in times)}); a run key has at most one "
            f"period. Make the other segments labels (e.g. a region)."
        )
    return out, times


def _instant_of(
    rule: RunKeyRule, parsed: TimeSegment, key: str, partition_date: dt.datetime | None
) -> tuple[TimeSegment, str]:
    """The time segment at its exact instant, and a note for the log: the run's partition
    date when it reads as the segment's wall-clock time; else the wall-clock time, refused
    for an hourly job when it names two hours or none."""
    exact = parsed.at(partition_date)
    fault = parsed.wall_clock_fault()
    wall = f"{parsed.wall:%Y-%m-%d %H:%M}" if parsed.wall else parsed.text
    if exact is not None:
        if fault != "ambiguous":
            return exact, ""
        instant = exact.start.in_timezone("UTC").to_iso8601_string()
        return exact, f"; {wall} happens twice there, the run's partition date {instant} says which"
    if fault is None or rule.period != "hour" or parsed.grain not in ("moment", "hour"):
        return parsed, ""
    if fault == "missing":
        raise InvalidRunKeyError(
            f"partition_key {key!r}: {wall} does not exist in {parsed.zone} (the clocks jump "
            f"over it), so it names no hour. Give the partition of the hour you mean, or "
            f"run_key in the format {rule.format_hint}."
        )
    first, second = (rule.key_for(i, "UTC", 0) for i in parsed.instants())
    raise InvalidRunKeyError(
        f"partition_key {key!r}: {wall} happens twice in {parsed.zone} (the clocks go back) "
        f"and this run has no partition date that says which. Give run_key {first!r} for "
        f"the first of the two hours or {second!r} for the second (hour keys are in UTC), "
        f'with "{OVERRIDE_FLAG}": true if the run keeps this partition_key.'
    )


def _period_of(
    rule: RunKeyRule, parsed: TimeSegment, key: str, timezone: str, now: dt.datetime
) -> str:
    if parsed.longer_than(rule.period):
        raise InvalidRunKeyError(
            f"partition_key {key!r}: {parsed.text!r} names a {parsed.grain}, but this job's run "
            f"keys are {rule.period}s ({rule.format_hint}). Key the job by that period "
            f"(RunKeyRule(period=...)) or partition the DAG by {rule.period}s."
        )
    period_key = rule.key_for(parsed.start, timezone, 0)
    rule.check_ended(period_key, timezone, now)
    return period_key


def _explicit_period_key(
    rule: RunKeyRule, explicit: object, timezone: str, now: dt.datetime
) -> str:
    """An explicit key for a period rule: a well-formed period that has ended, optionally
    with label segments (``eu|2026-10-01``), in its one spelling."""
    key = str(explicit) if isinstance(explicit, dt.date) else explicit
    if not isinstance(key, str):
        raise InvalidRunKeyError(
            f"run_key must be text in the format {rule.format_hint}, got {explicit!r}"
        )
    segments = key.split(SEGMENT_DELIMITER)
    if len(segments) == 1:
        rule.period_bounds(key, timezone)  # malformed: refused with the expected format
        rule.check_ended(key, timezone, now)
        return check_text(key, "run_key")
    pattern = _FORMATS[rule.period][0]
    periods = [s for s in segments if pattern.fullmatch(s)]
    for index, segment in enumerate(segments, start=1):
        if segment not in periods:
            check_label(segment, f"segment {index}", key)
    if len(periods) != 1:
        raise InvalidRunKeyError(
            f"malformed run_key {key!r}: a run key with segments has exactly one segment in "
            f"the format {rule.format_hint}, the others labels (e.g. eu|2026-10-01)"
        )
    rule.period_bounds(periods[0], timezone)
    rule.check_ended(periods[0], timezone, now)
    return check_key_text(key, "run_key")
