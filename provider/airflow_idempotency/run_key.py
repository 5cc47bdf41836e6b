"""Run keys: the name of the business period a run is for.

A run key is explicit text such as ``2026-10-01``. For scheduled and backfill runs it is
derived from Airflow's logical date by a :class:`RunKeyRule`; a manual run may name it
directly (``run_key`` in the run's conf or params). Nothing here ever falls back to "now".

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
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pendulum

from airflow_idempotency.exceptions import (
    InvalidInputError,
    InvalidRunKeyError,
    PeriodNotEndedError,
    RunKeyMissingError,
)

Period = Literal["hour", "day", "week", "month"]
MAX_KEY_LENGTH = 200

_FORMATS: dict[str, tuple[re.Pattern[str], str]] = {
    "hour": (
        re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2})Z"),
        "YYYY-MM-DDTHHZ (UTC), e.g. 2026-10-01T13Z",
    ),
    "day": (re.compile(r"(\d{4})-(\d{2})-(\d{2})"), "YYYY-MM-DD, e.g. 2026-10-01"),
    "week": (re.compile(r"(\d{4})-W(\d{2})"), "YYYY-Www (ISO week), e.g. 2026-W40"),
    "month": (re.compile(r"(\d{4})-(\d{2})"), "YYYY-MM, e.g. 2026-10"),
}

# Timetables whose logical date is the moment the run fires (no data interval): the period
# that just ended is the one before the logical date.
_TRIGGER_TIMETABLES = frozenset(
    {"CronTriggerTimetable", "MultipleCronTriggerTimetable", "DeltaTriggerTimetable"}
)


def check_text(value: object, what: str) -> str:
    """Validate free text used as a job name or run key; return it unchanged.

    Any printable text is allowed (quotes and unicode included: it only ever travels as a
    bound parameter); control characters, surrounding blanks and empty text are refused.
    """
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be text, got {type(value).__name__}: {value!r}")
    if not value or value != value.strip():
        raise InvalidInputError(f"{what} {value!r} is empty or has leading/trailing blanks")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidInputError(f"{what} is {len(value)} characters long; at most {MAX_KEY_LENGTH}")
    bad = [c for c in value if unicodedata.category(c) in ("Cc", "Cs", "Cn")]
    if bad:
        raise InvalidInputError(
            f"{what} {value!r} contains control or unassigned characters {bad!r}"
        )
    return value


@dataclass(frozen=True)
class RunKeyRule:
    """How a run's logical date becomes a run key.

    :param period: the business period a run covers: ``hour``, ``day``, ``week`` or ``month``.
    :param offset: periods to add to the period containing the logical date; ``None`` picks
        -1 for trigger timetables (cron schedules in Airflow 3) and 0 for data-interval ones.
    :param allow_open_period: accept keys whose period has not ended yet (default: refuse).
    """

    period: Period = "day"
    offset: int | None = None
    allow_open_period: bool = False

    def __post_init__(self) -> None:
        if self.period not in _FORMATS:
            raise InvalidInputError(
                f"unknown period {self.period!r}: use one of {sorted(_FORMATS)}"
            )

    @property
    def format_hint(self) -> str:
        """The expected format of a key, for error messages."""
        return _FORMATS[self.period][1]

    def effective_offset(self, timetable_name: str | None) -> int:
        """The offset in force for a DAG whose timetable class is ``timetable_name``."""
        if self.offset is not None:
            return self.offset
        return -1 if timetable_name in _TRIGGER_TIMETABLES else 0

    def key_for(self, logical_date: dt.datetime, timezone: str, offset: int) -> str:
        """The key of the period ``offset`` periods after the one holding ``logical_date``."""
        if logical_date.tzinfo is None:
            raise InvalidInputError(f"logical date {logical_date!r} has no timezone")
        if self.period == "hour":
            utc = pendulum.instance(logical_date).in_timezone("UTC").add(hours=offset)
            return utc.format("YYYY-MM-DD[T]HH[Z]")
        local = pendulum.instance(logical_date).in_timezone(timezone).date()
        if self.period == "day":
            return local.add(days=offset).isoformat()
        if self.period == "week":
            year, week, _ = local.add(weeks=offset).isocalendar()
            return f"{year:04d}-W{week:02d}"
        month = local.start_of("month").add(months=offset)
        return f"{month.year:04d}-{month.month:02d}"

    def period_bounds(self, key: str, timezone: str) -> tuple[pendulum.DateTime, pendulum.DateTime]:
        """Parse ``key`` (raising if malformed); return its [start, end) in ``timezone``."""
        pattern, hint = _FORMATS[self.period]
        match = pattern.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            raise InvalidRunKeyError(
                f"malformed run_key {key!r}: expected {hint}. Pass the business date the run "
                f'is for, for example conf {{"run_key": "2026-10-01"}}.'
            )
        numbers = [int(g) for g in match.groups()]
        try:
            if self.period == "hour":
                year, month, day, hour = numbers
                start = pendulum.datetime(year, month, day, hour, tz="UTC")
                return start, start.add(hours=1)
            if self.period == "day":
                year, month, day = numbers
                start = pendulum.datetime(year, month, day, tz=timezone)
                return start, start.add(days=1)
            if self.period == "week":
                monday = dt.date.fromisocalendar(numbers[0], numbers[1], 1)
                start = pendulum.datetime(monday.year, monday.month, monday.day, tz=timezone)
                return start, start.add(weeks=1)
            start = pendulum.datetime(numbers[0], numbers[1], 1, tz=timezone)
            return start, start.add(months=1)
        except (ValueError, OverflowError) as exc:  # Feb 30; a period ending after 9999
            raise InvalidRunKeyError(
                f"run_key {key!r} is not a real {self.period}: {exc}. Expected {hint}."
            ) from None

    def keys_between(self, first: str, last: str, timezone: str = "UTC") -> list[str]:
        """Every key from ``first`` to ``last``, both included, in order (both validated)."""
        start, _ = self.period_bounds(first, timezone)
        end, _ = self.period_bounds(last, timezone)
        if end < start:
            raise InvalidInputError(
                f"the range {first} .. {last} is empty: the first key comes after the last"
            )
        keys = []
        key = first
        while True:
            keys.append(key)
            if key == last:
                return keys
            _, period_end = self.period_bounds(key, timezone)
            key = self.key_for(period_end, timezone, 0)

    @classmethod
    def for_key(cls, key: str) -> RunKeyRule:
        """The rule whose period ``key`` is written in (``2026-10`` -> month, ...)."""
        for period, (pattern, _) in _FORMATS.items():
            if isinstance(key, str) and pattern.fullmatch(key):
                return cls(period=period)  # type: ignore[arg-type]
        hints = "; ".join(hint for _, hint in _FORMATS.values())
        raise InvalidRunKeyError(f"{key!r} is not a run key of any period: expected {hints}")

    def check_ended(self, key: str, timezone: str, now: dt.datetime) -> None:
        """Refuse ``key`` when its period has not ended at ``now`` (unless allowed)."""
        _, end = self.period_bounds(key, timezone)
        if not self.allow_open_period and end > now:
            raise PeriodNotEndedError(
                f"run_key {key!r} names a {self.period} that has not ended yet in {timezone} "
                f"(it ends {end.to_iso8601_string()}). If you clicked Trigger in the UI, the "
                f"logical date was pre-filled with the current time: set run_key to the "
                f"business date you mean (for example yesterday's date), or let the DAG "
                f"author set allow_open_period=True if running an open period is intended."
            )


RunKeyCallable = Callable[[Any], str]
"""A custom rule: takes the Airflow task context, returns the run key (free text)."""

_MANUAL_RUN_TYPES = frozenset({"manual", "operator_triggered"})


@dataclass(frozen=True)
class ResolvedRunKey:
    """A run key and a sentence saying where it came from, for the task log."""

    run_key: str
    source: Literal["conf", "params", "logical_date", "callable"]
    explanation: str


def resolve_run_key(
    *,
    rule: RunKeyRule | RunKeyCallable,
    timezone: str,
    timetable_name: str | None,
    run_type: str,
    logical_date: dt.datetime | None,
    conf_run_key: object = None,
    params_run_key: object = None,
    now: dt.datetime,
    context: Any = None,
) -> ResolvedRunKey:
    """Decide the run key of one task execution, or raise :class:`InvalidRunKeyError`.

    The one place that decides: the operator only reads these facts from Airflow's context.
    An explicit ``run_key`` (the run's conf first, then its params; ``None`` and ``""``
    mean "not given") wins for manual runs. Scheduled, backfill and asset-triggered runs
    always derive it from the logical date: a run_key in their conf would map a whole
    backfill onto one key, so it is refused. A callable ``rule`` is called with
    ``context`` (the Airflow task context) when no explicit key applies; an explicit key
    is then free text, checked like any key but not parsed as a period.
    """
    source: Literal["conf", "params"] = "conf" if conf_run_key not in (None, "") else "params"
    explicit = conf_run_key if source == "conf" else params_run_key
    manual = run_type in _MANUAL_RUN_TYPES
    if explicit not in (None, ""):
        if not manual:
            raise InvalidRunKeyError(
                f"run_key {explicit!r} was given to a {run_type} run; only manual runs take an "
                "explicit run_key. Remove it from the conf: backfill and scheduled runs derive "
                "the run key from each run's logical date."
            )
        if not isinstance(rule, RunKeyRule):
            key = check_text(explicit, "run_key")
        else:
            key = _explicit_period_key(rule, explicit, timezone, now)
        return ResolvedRunKey(
            key, source, f"run_key {key!r} given explicitly in the run's {source}"
        )
    if not isinstance(rule, RunKeyRule):
        key = check_text(rule(context), "run key from run_key_rule")
        return ResolvedRunKey(key, "callable", f"run_key {key!r} from the DAG's run_key_rule")
    if logical_date is None:
        raise RunKeyMissingError(
            f"this {run_type} run has no logical date and no run_key, so it does not say which "
            f"business period to process. Trigger it again with run_key in the conf, in the "
            f"format {rule.format_hint} (for example: airflow dags trigger DAG_ID -c "
            f'\'{{"run_key": "2026-10-01"}}\', or fill in the run_key field of the trigger form).'
        )
    offset = rule.effective_offset(timetable_name)
    key = rule.key_for(logical_date, timezone, offset)
    rule.check_ended(key, timezone, now)
    local = pendulum.instance(logical_date).in_timezone(timezone).to_iso8601_string()
    explanation = (
        f"run_key {key!r} derived from the logical date {local} ({timezone}) with offset "
        f"{offset} {rule.period}(s) for timetable {timetable_name or 'unknown'}"
    )
    if manual:
        explanation = (
            f"NOTE: this manual run has no explicit run_key, so {explanation}. If that is not "
            f"the business period you meant, trigger again with run_key set."
        )
    return ResolvedRunKey(key, "logical_date", explanation)


def _explicit_period_key(
    rule: RunKeyRule, explicit: object, timezone: str, now: dt.datetime
) -> str:
    """An explicit key for a period rule: a well-formed period that has ended."""
    key = str(explicit) if isinstance(explicit, dt.date) else explicit
    if not isinstance(key, str):
        raise InvalidRunKeyError(
            f"run_key must be text in the format {rule.format_hint}, got {explicit!r}"
        )
    rule.period_bounds(key, timezone)
    rule.check_ended(key, timezone, now)
    return key
