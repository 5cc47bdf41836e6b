"""The zone rule: a job's day, week and month keys are read in one timezone.

``2026-10-01`` names a day only together with a zone: in Europe/Amsterdam it starts at
2026-09-30 22:00 UTC, in UTC two hours later. A DAG whose timezone changes would silently
redefine every key of its jobs: the same text, another day, and a completed key a no-op
for data it never saw. So every run records the zone its key was made in
(``job_runs.key_zone``, migration 0009), and a run whose key was made in another zone than
the job's earlier keys is refused before anything is written, naming both zones and what
to do (:func:`check_key_zone`). Hour keys are UTC (``2026-10-25T01Z``) and keys of no period
have no zone: neither is checked. One zone written another way (``Etc/UTC`` for ``UTC``, a
fixed ``+00:00``, a link of tzdata such as ``Europe/Kiev`` for ``Europe/Kyiv``) names the
same periods and is no change (:func:`same_zone`).
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import re
import zoneinfo
from collections.abc import Iterable
from typing import Any

import psycopg

from airflow_idempotency._sql import query_rows
from airflow_idempotency.exceptions import ConfigurationError


def check_key_zone(
    conn: psycopg.Connection, schema: str, job_name: str, run_key: str, zone: str | None
) -> None:
    """Refuse ``run_key`` of ``job_name``, made in ``zone``, when the job's recorded keys
    were made in another zone (``None``: a key of no zone, never refused)."""
    if zone is None:
        return
    params = {"job_name": job_name, "key_zone": zone}
    refuse_zone_change(
        job_name, run_key, zone, query_rows(conn, "key_zone_conflict", schema, params)
    )


def refuse_zone_change(
    job_name: str, run_key: str, zone: str, conflicts: Iterable[dict[str, Any]]
) -> None:
    """Raise :class:`ConfigurationError` when one of the job's recorded keys whose zone is
    spelled differently (``conflicts``, rows with ``key_zone``) was made in another zone."""
    for earlier in conflicts:
        if not same_zone(earlier["key_zone"], zone):
            raise ConfigurationError(zone_changed_message(job_name, run_key, zone, earlier))


_FIXED = re.compile(r"([+-])([0-9]{2}):([0-9]{2})")


@functools.lru_cache(maxsize=256)
def _zone_identity(name: str) -> object:
    """What a zone is, whatever its name: the bytes of its tzdata file (a link has its
    target's), a fixed offset in seconds (UTC and GMT: 0), or the name if neither is found."""
    fixed = _FIXED.fullmatch(name)
    if fixed:
        sign = -1 if fixed[1] == "-" else 1
        return sign * (int(fixed[2]) * 3600 + int(fixed[3]) * 60)
    data = _tzfile(name)
    if data is None:
        return name
    return 0 if data in (_tzfile("Etc/UTC"), _tzfile("Etc/GMT")) else data


def _tzfile(name: str) -> bytes | None:
    """The tzdata file of the IANA zone ``name`` where zoneinfo reads it, or ``None``."""
    try:
        zoneinfo.ZoneInfo(name)  # a valid key (no path tricks), and one zoneinfo can load
    except (ValueError, zoneinfo.ZoneInfoNotFoundError):
        return None
    for root in zoneinfo.TZPATH:
        path = os.path.join(root, name)
        if os.path.isfile(path):
            with open(path, "rb") as file:
                return file.read()
    try:
        return importlib.resources.files("tzdata.zoneinfo").joinpath(*name.split("/")).read_bytes()
    except (ModuleNotFoundError, OSError):
        return None


def same_zone(first: str, second: str) -> bool:
    """Whether two zone names name one zone: equal, links of one tzdata zone, or UTC in any
    spelling (``UTC``, ``Etc/UTC``, ``GMT``, ``+00:00``)."""
    return first == second or _zone_identity(first) == _zone_identity(second)


def zone_changed_message(job_name: str, run_key: str, zone: str, earlier: dict[str, Any]) -> str:
    """What a run refused by the zone rule says: both zones and the three ways on."""
    old = earlier["key_zone"]
    return (
        f"job {job_name!r}: run key {run_key!r} was made in the timezone {zone}, but the job's "
        f"{earlier['keys']} earlier key(s) (the latest {earlier['run_key']!r}) were made in "
        f"{old}: the same key would now name another period, so nothing was done. If the "
        f"DAG's timezone changed by mistake, set it back to {old}. To keep the job's keys "
        f"in {old} while the DAG runs in {zone}, give the operator "
        f"run_key_rule=RunKeyRule(..., timezone={old!r}). To start the job's keys afresh in "
        f"{zone}, give the task a new job_name (the old keys stay with the old name)."
    )
