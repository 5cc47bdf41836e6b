"""The calendar of a job's business periods: which periods a window holds, laid out in rows.

A job's run keys name hours, days, ISO weeks or months (:mod:`airflow_idempotency.run_key`);
the calendar shows them as a grid of rows, each row the periods of one longer unit:

=======  ===================  =====================  ===============
period   key                  a row                  columns
=======  ===================  =====================  ===============
hour     ``2026-10-01T13Z``   a UTC day              00 .. 23
day      ``2026-10-01``       a month                1 .. 31
week     ``2026-W40``         an ISO year            1 .. 53
month    ``2026-10``          a year                 Jan .. Dec
=======  ===================  =====================  ===============

A window is a range of whole rows (by default the :data:`DEFAULT_ROWS` rows ending with the
row of the job's newest key), or the periods between two keys given by the reader, at most
:data:`MAX_ROWS` rows. Pure functions, Airflow- and database-free.
"""

from __future__ import annotations

import calendar as _calendar
import datetime as dt
from dataclasses import dataclass

from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.run_key import Period, RunKeyRule

DEFAULT_ROWS: dict[str, int] = {"hour": 7, "day": 12, "week": 3, "month": 10}
"""Rows of a default window: a week of hours, a year of days, 3 years of weeks, 10 of months."""

MAX_ROWS: dict[str, int] = {"hour": 62, "day": 40, "week": 25, "month": 100}
"""The most rows a window may have (about 1,500 periods of hours, 1,200 of days)."""

_MONTHS = [_calendar.month_abbr[m] for m in range(1, 13)]


def columns(period: Period) -> list[str]:
    """The column headers of a row."""
    if period == "hour":
        return [f"{h:02d}" for h in range(24)]
    if period == "day":
        return [str(d) for d in range(1, 32)]
    if period == "week":
        return [str(w) for w in range(1, 54)]
    return list(_MONTHS)


def row_of(period: Period, key: str) -> int:
    """The row of a well-formed key of ``period``, as a number (consecutive rows: +1)."""
    if period == "hour":
        return dt.date.fromisoformat(key[:10]).toordinal()
    if period == "day":
        return int(key[:4]) * 12 + int(key[5:7]) - 1
    return int(key[:4])  # week: the ISO year; month: the year


def row_label(period: Period, row: int) -> str:
    if period == "hour":
        return dt.date.fromordinal(row).isoformat()
    if period == "day":
        return f"{row // 12:04d}-{row % 12 + 1:02d}"
    return f"{row:04d}"


def row_periods(period: Period, row: int) -> list[str | None]:
    """The keys of a row, by column; None where the row has no such period (Feb 30, W53)."""
    if period == "hour":
        day = dt.date.fromordinal(row).isoformat()
        return [f"{day}T{h:02d}Z" for h in range(24)]
    if period == "day":
        year, month = row // 12, row % 12 + 1
        days = _calendar.monthrange(year, month)[1]
        return [f"{year:04d}-{month:02d}-{d:02d}" if d <= days else None for d in range(1, 32)]
    if period == "week":
        weeks = dt.date(row, 12, 28).isocalendar()[1]
        return [f"{row:04d}-W{w:02d}" if w <= weeks else None for w in range(1, 54)]
    return [f"{row:04d}-{m:02d}" for m in range(1, 13)]


def _row_in_range(period: Period, row: int) -> bool:
    low = {"hour": dt.date(1, 1, 2).toordinal(), "day": 12, "week": 2}.get(period, 1)
    high = {"hour": dt.date(9999, 12, 30).toordinal(), "day": 9999 * 12 + 11}.get(period, 9998)
    return low <= row <= high


@dataclass(frozen=True)
class Window:
    """The periods from ``from_key`` to ``to_key`` (both included), on rows ``first_row`` to
    ``last_row``."""

    period: Period
    from_key: str
    to_key: str
    first_row: int
    last_row: int

    @property
    def rows(self) -> int:
        return self.last_row - self.first_row + 1

    def grid(self) -> list[tuple[str, list[str | None]]]:
        """(row label, keys by column) for every row; None outside the window."""
        return [
            (
                row_label(self.period, row),
                [
                    key if key is not None and self.from_key <= key <= self.to_key else None
                    for key in row_periods(self.period, row)
                ],
            )
            for row in range(self.first_row, self.last_row + 1)
        ]

    def shifted(self, rows: int) -> Window | None:
        """The window of as many whole rows, ``rows`` rows later (earlier if negative)."""
        first, last = self.first_row + rows, self.last_row + rows
        if not (_row_in_range(self.period, first) and _row_in_range(self.period, last)):
            return None
        return rows_window(self.period, first, last)


def rows_window(period: Period, first_row: int, last_row: int) -> Window:
    """The window of whole rows ``first_row`` .. ``last_row``."""
    first = next(k for k in row_periods(period, first_row) if k is not None)
    last = [k for k in row_periods(period, last_row) if k is not None][-1]
    return Window(period, first, last, first_row, last_row)


def default_window(period: Period, newest_key: str) -> Window:
    """The :data:`DEFAULT_ROWS` whole rows ending with the row of ``newest_key``."""
    last = row_of(period, newest_key)
    first = last - DEFAULT_ROWS[period] + 1
    while not _row_in_range(period, first):
        first += 1
    return rows_window(period, first, last)


def window(period: Period, from_key: str, to_key: str) -> Window:
    """The window from ``from_key`` to ``to_key``, both keys of ``period``: refused (with
    what was wrong) if either is malformed, if they are in the wrong order, or if the window
    is longer than :data:`MAX_ROWS` rows."""
    rule = RunKeyRule(period=period)
    for name, key in (("from", from_key), ("to", to_key)):
        try:
            rule.period_bounds(key, "UTC")
        except InvalidInputError as exc:
            raise InvalidInputError(
                f"{name}={key!r} is not a run key of this job's periods ({period}s, "
                f"{rule.format_hint}): {exc}"
            ) from None
    if to_key < from_key:
        raise InvalidInputError(f"from={from_key!r} comes after to={to_key!r}")
    first, last = row_of(period, from_key), row_of(period, to_key)
    if last - first + 1 > MAX_ROWS[period]:
        raise InvalidInputError(
            f"{from_key} .. {to_key} spans {last - first + 1} rows of the calendar; at most "
            f"{MAX_ROWS[period]} for {period}s: narrow the range"
        )
    return Window(period, from_key, to_key, first, last)


__all__ = ["DEFAULT_ROWS", "MAX_ROWS", "Window", "columns", "default_window", "window"]
