"""RunKeyRule: how a run's logical date becomes a run key, and what period a key names.

A :class:`RunKeyRule` says which business period a job's runs cover (hour, day, week or
month) and the offset from the logical date: it writes the key of a period
(``key_for``), parses a key back to its [start, end) (``period_bounds``) and refuses a
period that has not ended (``check_ended``). Which key a run gets is decided in
:mod:`airflow_idempotency.run_key`, which re-exports these names.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Literal

import pendulum

from airflow_idempotency.exceptions import (
    InvalidInputError,
    InvalidRunKeyError,
    PeriodNotEndedError,
)
from airflow_idempotency.key_spelling import (
    PERIOD_FORMATS,
    check_text,
    refuse_foreign_spelling,
    spelling_of,
)

Period = Literal["hour", "day", "week", "month"]
MAX_OFFSET = 1000
"""The largest shift a :class:`RunKeyRule` offset may give (in periods, either way)."""

_FORMATS = PERIOD_FORMATS

# Timetables whose logical date is the moment the run fires (no data interval): the period
# that just ended is the one before the logical date.
_TRIGGER_TIMETABLES = frozenset(
    {"CronTriggerTimetable", "MultipleCronTriggerTimetable", "DeltaTriggerTimetable"}
)


@dataclass(frozen=True)
class RunKeyRule:
    """How a run's logical date becomes a run key.

    :param period: the business period a run covers: ``hour``, ``day``, ``week`` or ``month``.
    :param offset: periods to add to the period containing the logical date; ``None`` picks
        -1 for trigger timetables (cron schedules in Airflow 3) and 0 for data-interval ones.
    :param allow_open_period: accept keys whose period has not ended yet (default: refuse).
    :param timezone: the zone day, week and month keys are read in; ``None``: the DAG's
        (a partition's wall-clock time is still read in its timetable's zone). Keeps a job's
        keys in the zone they were made in when the DAG's own zone changes (the zone rule).
    """

    period: Period = "day"
    offset: int | None = None
    allow_open_period: bool = False
    timezone: str | None = None

    def __post_init__(self) -> None:
        # Checked when the DAG file builds the rule: a mistake is the file's import error.
        if not isinstance(self.period, str) or self.period not in _FORMATS:
            raise InvalidInputError(
                f"unknown period {self.period!r}: use one of {sorted(_FORMATS)}"
            )
        offset = self.offset
        if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool)):
            raise InvalidInputError(
                f"offset must be a whole number of {self.period}s (or None for the "
                f"timetable's default), got {type(offset).__name__}: {offset!r}"
            )
        if offset is not None and abs(offset) > MAX_OFFSET:
            raise InvalidInputError(
                f"offset {offset} moves keys more than {MAX_OFFSET} {self.period}s: use an "
                "offset of a few periods (-1: the period before the logical date's)"
            )
        if not isinstance(self.allow_open_period, bool):
            raise InvalidInputError(
                f"allow_open_period must be True or False, got {self.allow_open_period!r}"
            )
        if self.timezone is not None:
            try:
                pendulum.timezone(self.timezone)
            except (ValueError, TypeError):
                raise InvalidInputError(
                    f"timezone {self.timezone!r} is no timezone: give an IANA name such as "
                    "'Europe/Amsterdam', or None for the DAG's"
                ) from None

    def zone_of_keys(self, timezone: str) -> str | None:
        """The zone this rule's keys are made in for a DAG in ``timezone``: none for hour
        keys (UTC), else the rule's own or the DAG's."""
        return None if self.period == "hour" else (self.timezone or timezone)

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
            if isinstance(key, str):
                refuse_foreign_spelling(key, "run_key")
                try:
                    check_text(key, "run_key")
                except InvalidInputError as exc:
                    raise InvalidRunKeyError(f"{exc}. Expected {hint}.") from None
            meant = spelling_of(key, self.period)
            if meant is not None:
                hint = f"{hint}; its one spelling is {meant!r}"
            example = hint.rsplit("e.g. ", 1)[-1]
            raise InvalidRunKeyError(
                f"malformed run_key {key!r}: expected {hint}. Pass the business period the "
                f'run is for, for example conf {{"run_key": "{example}"}}.'
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
        if isinstance(key, str):
            refuse_foreign_spelling(key, "run key")
        meant = [m for m in (spelling_of(key, p) for p in _FORMATS) if m is not None]
        if meant:
            raise InvalidRunKeyError(
                f"{key!r} is a period written another way: its one spelling is {meant[0]!r}"
            )
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
