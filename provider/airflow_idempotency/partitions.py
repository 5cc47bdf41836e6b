"""Airflow's partitions (3.2+), as run keys read them: partition specs and time segments.

How a DAG writes its partition keys (:class:`PartitionSpec`, read from its timetable and
partition mappers by :func:`dag_partitioning`), and the time segments of a key
(:func:`parse_time_segment`).

What a partition key's run key is, is decided with every other run key in
:mod:`airflow_idempotency.run_key` (:func:`~airflow_idempotency.run_key.partition_run_key`).
Nothing here imports Airflow but :func:`dag_partitioning` (for the line's version), which
is only given a DAG where Airflow runs.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, replace
from typing import Any

import pendulum

from airflow_idempotency.exceptions import InvalidRunKeyError

SEGMENT_DELIMITER = "|"
"""Separates the segments of a run key (``eu|2026-10-01``), as Airflow's ProductMapper does."""

# How fine a time segment is: a moment, or the start of an hour, day, ISO week, month,
# quarter or year. A segment may be keyed by a period as long as or longer than its own
# grain (the 01:00 moment of a day -> that day), never by a shorter one.
_GRAINS = ("moment", "hour", "day", "week", "month", "quarter", "year")
_PERIOD_RANK = {"hour": 1, "day": 2, "week": 3, "month": 4}

# The strptime-style formats Airflow writes time partition keys in, besides what a DAG's
# timetable declares: CronPartitionTimetable's default key_format and the default output
# formats of StartOfHourMapper, StartOfDayMapper, StartOfWeekMapper, StartOfMonthMapper,
# StartOfQuarterMapper; then run_key's own hour and ISO-week keys.
DEFAULT_TIME_FORMATS = (
    "%Y-%m-%dT%H:%M:%S",
    "%Y-%m-%dT%H:%M:%S%z",
    "%Y-%m-%dT%H",
    "%Y-%m-%d",
    "%Y-%m-%d (W%V)",
    "%Y-%m",
    "%Y-Q{quarter}",
    "%Y-%m-%dT%H%z",  # run_key's own hour keys (2026-10-01T13Z): UTC
    "%G-W%V",
)

_DIRECTIVES = {
    "%Y": r"(?P<Y>[0-9]{4})",
    "%G": r"(?P<G>[0-9]{4})",
    "%m": r"(?P<m>[0-9]{2})",
    "%d": r"(?P<d>[0-9]{2})",
    "%H": r"(?P<H>[0-9]{2})",
    "%M": r"(?P<M>[0-9]{2})",
    "%S": r"(?P<S>[0-9]{2})",
    "%V": r"(?P<V>[0-9]{2})",
    "%z": r"(?P<z>Z|[+-][0-9]{2}:?[0-9]{2})",
    "{quarter}": r"(?P<q>[1-4])",
}


def format_pattern(fmt: str) -> re.Pattern[str]:
    """A strptime-style format as an anchored regular expression with named groups (the
    directives Airflow's partition formats use; anything else matches literally). Digits
    are ASCII: ``int()`` would read fullwidth or Arabic-Indic ones as the same number."""
    parts, i = [], 0
    while i < len(fmt):
        token = next((t for t in _DIRECTIVES if fmt.startswith(t, i)), None)
        if token is None:
            parts.append(re.escape(fmt[i]))
            i += 1
        else:
            parts.append(_DIRECTIVES[token])
            i += len(token)
    return re.compile("".join(parts))


def _grain(groups: dict[str, str]) -> str:
    if "M" in groups or "S" in groups:
        return "moment"
    if "H" in groups:
        return "hour"
    if "V" in groups:  # StartOfWeekMapper's 2026-09-28 (W40) names the week of that Monday
        return "week"
    if "d" in groups:
        return "day"
    if "m" in groups:
        return "month"
    return "quarter" if "q" in groups else "year"


@dataclass(frozen=True)
class TimeSegment:
    """A time segment of a partition key, parsed: its start and how long a period it names.

    ``wall`` and ``zone``: the wall-clock time the text names and the zone it was read in,
    when the text carries no UTC offset (a wall-clock time may happen twice, or never,
    where clocks change).
    """

    text: str
    start: pendulum.DateTime
    grain: str
    wall: dt.datetime | None = None
    zone: str | None = None

    def longer_than(self, period: str) -> bool:
        """Whether the segment names a longer period than ``period`` (a run key's: ``hour``,
        ``day``, ``week`` or ``month``), so that it cannot be keyed by it."""
        return _GRAINS.index(self.grain) > _PERIOD_RANK[period]

    def at(self, instant: dt.datetime | None) -> TimeSegment | None:
        """This segment starting at ``instant`` (the run's partition date, an exact
        instant) when ``instant`` reads as the segment's wall-clock time in its zone: it
        says which of two 02:00 hours an autumn key means. ``None`` when it does not."""
        if instant is None or self.wall is None or self.zone is None:
            return None
        local = pendulum.instance(instant).in_timezone(self.zone)
        if local.naive() != self.wall:
            return None
        return replace(self, start=local)

    def wall_clock_fault(self) -> str | None:
        """``ambiguous`` when the wall-clock time happens twice in the zone (clocks go
        back), ``missing`` when it never happens (clocks jump over it), else ``None``."""
        if self.wall is None or self.zone is None:
            return None
        zone = pendulum.timezone(self.zone)
        first, second = (self.wall.replace(tzinfo=zone, fold=f) for f in (0, 1))
        if first.utcoffset() == second.utcoffset():
            return None
        back = first.astimezone(dt.timezone.utc).astimezone(zone).replace(tzinfo=None)
        return "ambiguous" if back == self.wall else "missing"

    def instants(self) -> tuple[dt.datetime, dt.datetime]:
        """The two readings of the wall-clock time (fold 0 and 1), in UTC."""
        assert self.wall is not None and self.zone is not None
        zone = pendulum.timezone(self.zone)
        first, second = (
            self.wall.replace(tzinfo=zone, fold=f).astimezone(dt.timezone.utc) for f in (0, 1)
        )
        return first, second


def parse_time_segment(text: str, formats: tuple[str, ...], timezone: str) -> TimeSegment | None:
    """``text`` read with the first of ``formats`` that matches it whole (a wall-clock time
    in ``timezone`` unless it carries an offset), or ``None`` when none does.

    Text of a time format that is no real time (``2026-13-01``, ``2026-02-30T01:00:00``)
    is refused: taken as a label, it would be a run key of no period.
    """
    impossible: str | None = None
    for fmt in formats:
        match = format_pattern(fmt).fullmatch(text)
        if match is None:
            continue
        groups = {k: v for k, v in match.groupdict().items() if v is not None}
        try:
            wall = _segment_wall(groups)
            start = _segment_start(wall, groups, timezone)
        except (ValueError, OverflowError) as exc:
            impossible = f"{exc} (format {fmt})"
            continue
        if "z" in groups:
            return TimeSegment(text, start, _grain(groups))
        return TimeSegment(text, start, _grain(groups), wall, timezone)
    if impossible is not None:
        raise InvalidRunKeyError(
            f"partition key segment {text!r} is written like a time but is none: {impossible}"
        )
    return None


def _segment_wall(groups: dict[str, str]) -> dt.datetime:
    """The naive wall-clock time a segment's fields name."""
    if "G" in groups and "V" in groups:
        monday = dt.date.fromisocalendar(int(groups["G"]), int(groups["V"]), 1)
        year, month, day = monday.year, monday.month, monday.day
    else:
        year = int(groups["Y"])
        month = (int(groups["q"]) - 1) * 3 + 1 if "q" in groups else int(groups.get("m", 1))
        day = int(groups.get("d", 1))
    hour, minute, second = (int(groups.get(k, 0)) for k in ("H", "M", "S"))
    return dt.datetime(year, month, day, hour, minute, second)


def _segment_start(naive: dt.datetime, groups: dict[str, str], timezone: str) -> pendulum.DateTime:
    zone = groups.get("z")
    if zone is None:
        return pendulum.instance(naive, tz=timezone)
    offset = dt.datetime.strptime(zone.replace("Z", "+0000").replace(":", ""), "%z").tzinfo
    return pendulum.instance(naive.replace(tzinfo=offset))


@dataclass(frozen=True)
class PartitionSpec:
    """How a DAG writes its partition keys, read from its timetable (:func:`dag_partitioning`).

    :param time_formats: strptime-style formats the timetable writes time segments in
        (CronPartitionTimetable's ``key_format``, its mappers' ``output_format``); tried
        before :data:`DEFAULT_TIME_FORMATS`.
    :param timezone: the wall-clock of time segments without an offset: the timetable's
        (or its mapper's) timezone; ``None``: the DAG's.
    :param delimiter: what separates the segments of a composite key (ProductMapper's).
    """

    time_formats: tuple[str, ...] = ()
    timezone: str | None = None
    delimiter: str = SEGMENT_DELIMITER


# -- a DAG's partitions, read from its timetable ------------------------------------------

PARTITIONED_TIMETABLES = frozenset({"CronPartitionTimetable", "PartitionedAssetTimetable"})


def dag_partitioning(dag: Any) -> tuple[bool, PartitionSpec]:
    """Whether ``dag`` makes partitioned runs, and how its timetable writes partition keys
    (the SDK classes of 3.2+: CronPartitionTimetable's ``key_format`` and timezone, the
    partition mappers of a PartitionedAssetTimetable). Never partitioned before 3.2."""
    from airflow_idempotency.compat import AIRFLOW_V_3_2_PLUS

    timetable = getattr(dag, "timetable", None) if dag is not None else None
    if not AIRFLOW_V_3_2_PLUS or timetable is None:
        return False, PartitionSpec()
    # The Task SDK's timetable classes (what a DAG file builds) have no ``partitioned``
    # attribute; the scheduler's have. Either way, these are the partitioned ones.
    partitioned = bool(
        getattr(timetable, "partitioned", False)
        or getattr(timetable, "partitioned_at_runtime", False)
        or type(timetable).__name__ in PARTITIONED_TIMETABLES
    )
    formats: list[str] = []
    zones: list[str] = []
    delimiters: list[str] = []
    if isinstance(getattr(timetable, "key_format", None), str):  # CronPartitionTimetable
        formats.append(timetable.key_format)
        zones.append(_zone_name(getattr(timetable, "timezone", None)))
    mappers = list((getattr(timetable, "partition_mapper_config", None) or {}).values())
    if getattr(timetable, "default_partition_mapper", None) is not None:
        mappers.append(timetable.default_partition_mapper)
    for mapper in mappers:
        _walk_mapper(mapper, formats, zones, delimiters)
    zone = zones[0] if zones and all(z == zones[0] for z in zones) else None
    delimiter = delimiters[0] if delimiters else PartitionSpec.delimiter
    return partitioned, PartitionSpec(tuple(dict.fromkeys(formats)), zone, delimiter)


def _walk_mapper(mapper: Any, formats: list[str], zones: list[str], delimiters: list[str]) -> None:
    """Collect what a partition mapper writes: temporal mappers' output formats and
    timezones, ProductMapper's delimiter, through Chain, Rollup and FanOut mappers."""
    if isinstance(getattr(mapper, "output_format", None), str):
        formats.append(mapper.output_format)
        zones.append(_zone_name(getattr(mapper, "_timezone", None)))
    if isinstance(getattr(mapper, "delimiter", None), str):
        delimiters.append(mapper.delimiter)
    children = list(getattr(mapper, "mappers", None) or [])
    children += [getattr(mapper, a, None) for a in ("upstream_mapper", "downstream_mapper")]
    for child in children:
        if child is not None:
            _walk_mapper(child, formats, zones, delimiters)


def _zone_name(zone: Any) -> str:
    return str(getattr(zone, "name", None) or zone or "UTC")
