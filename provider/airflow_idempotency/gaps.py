"""What is missing, for the on-call engineer: gaps and stale runs.

Gaps are business periods without a completed run; stale runs are work that stopped and that
nothing retried.

Airflow-free reads over the bookkeeping tables, shared by the CLI (``gaps``, ``runs
--stale``) and the example watch DAG (:func:`problems`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import psycopg

from airflow_idempotency._sql import query_rows
from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.run_key import KeyParts, RunKeyRule, key_parts, segment_template

GapKind = Literal["missing", "failed", "started"]


@dataclass(frozen=True)
class Gap:
    """A business period of a job with no completed run."""

    run_key: str
    kind: GapKind  # missing: never run; failed; started: in progress or abandoned
    attempts: int
    updated_at: dt.datetime | None
    last_error: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key,
            "state": self.kind,
            "attempts": self.attempts,
            "updated_at": self.updated_at,
            "last_error": self.last_error,
        }


def require_known_job(conn: psycopg.Connection, schema: str, job: str) -> None:
    """Refuse a job name nothing was ever recorded for (a typo), naming the jobs there are."""
    (row,) = query_rows(conn, "job_known", schema, {"job": job})
    if row["known"]:
        return
    known = [r["job_name"] for r in query_rows(conn, "known_jobs", schema, {})]
    listed = ", ".join(known) if known else "none yet"
    raise InvalidInputError(f"no job named {job!r} has run here (jobs: {listed})")


def gaps(
    conn: psycopg.Connection,
    schema: str,
    job: str,
    first: str,
    last: str,
    *,
    segment: str | None = None,
    due: Collection[str] | None = None,
) -> list[Gap]:
    """The periods from ``first`` to ``last`` (run keys, both included, of one period kind:
    days, hours, ISO weeks or months) of ``job`` that have no completed run, in order.

    Per segment: ``segment`` (``eu``, ``eu|*``, ``*|web``; ``""`` for plain keys) or, by
    default, every segment the job has recorded keys of (plain keys when it has none).
    A period is a gap only when it is due: when ``due`` (the keys the DAG's schedule made
    due, ``planning.due_keys``) is given, only those keys; otherwise every period that has
    ended (in UTC). A weekday-only job's weekends and a period not yet due are no gaps.
    """
    rule = RunKeyRule.for_key(first)
    if rule.period != RunKeyRule.for_key(last).period:
        raise InvalidInputError(f"{first!r} and {last!r} are keys of different periods")
    periods = rule.keys_between(first, last)
    if len(periods) > 100_000:
        raise InvalidInputError(f"{first} .. {last} is {len(periods):,} periods: narrow the range")
    wanted = segment_template(segment).template if segment is not None else None
    if due is not None:  # the schedule says which keys exist: a job never run has gaps too
        # Due keys of any grain inside the window: the hours of an hourly partitioned job
        # are checked by a window of days (the watch DAG's).
        window = (rule.period_bounds(first, "UTC")[0], rule.period_bounds(last, "UTC")[1])
        keys = sorted(
            (k for k in due if _wanted(key_parts(k), window, wanted)),
            key=lambda k: (_start(key_parts(k).period), k),
        )
    else:
        require_known_job(conn, schema, job)
        templates = (
            [segment_template(segment)]
            if segment is not None
            else _segments(conn, schema, job, rule)
        )
        moment = dt.datetime.now(dt.timezone.utc)
        ended = [p for p in periods if rule.period_bounds(p, "UTC")[1] <= moment]
        keys = [t.with_period(p) for p in ended for t in templates]
    rows = query_rows(conn, "runs_of_keys", schema, {"job": job, "keys": keys})
    found = {r["run_key"]: r for r in rows}
    result = []
    for key in keys:
        row = found.get(key)
        if row is None:
            result.append(Gap(key, "missing", 0, None, None))
        elif row["status"] != "completed":
            kind: GapKind = row["status"]
            result.append(
                Gap(key, kind, row["attempt_count"], row["updated_at"], row["last_error"])
            )
    return result


def _start(period: str | None) -> dt.datetime:
    """When the period of a key starts (in UTC, as gaps reads every key)."""
    if period is None:
        return dt.datetime.min.replace(tzinfo=dt.timezone.utc)
    return RunKeyRule.for_key(period).period_bounds(period, "UTC")[0]


def _wanted(
    parts: KeyParts, window: tuple[dt.datetime, dt.datetime], template: tuple[str, ...] | None
) -> bool:
    if parts.period is None or not window[0] <= _start(parts.period) < window[1]:
        return False
    return template is None or parts.template == template


def _segments(conn: psycopg.Connection, schema: str, job: str, rule: RunKeyRule) -> list[KeyParts]:
    """The segments of the job's recorded keys of ``rule``'s period, plain keys first if it
    has any (or none with segments)."""
    found: dict[tuple[str, ...], KeyParts] = {}
    for row in query_rows(conn, "segmented_keys_of_job", schema, {"job": job}):
        parts = key_parts(row["run_key"])
        if parts.period is not None and RunKeyRule.for_key(parts.period).period == rule.period:
            found.setdefault(parts.template, parts)
    plain = segment_template("")
    if not found or _has_plain_keys(conn, schema, job):
        found = {plain.template: plain, **found}
    return list(found.values())


def _has_plain_keys(conn: psycopg.Connection, schema: str, job: str) -> bool:
    (row,) = query_rows(conn, "job_has_plain_keys", schema, {"job": job})
    return bool(row["found"])


def stale(conn: psycopg.Connection, schema: str, job: str | None = None) -> list[dict[str, Any]]:
    """Attempts still running whose lock nobody holds for them (the advisory mode: their lock
    session ended; the lease mode: their lease expired or is gone), and keys still started
    with no live attempt: a worker died and nothing retried it yet. Oldest first, with their
    age and ``lock``: what became of the lock."""
    found = query_rows(conn, "stale_runs", schema, {"job": job})
    for row in found:
        row["lock"] = _lock_gone(row)
    return found


def _lock_gone(row: dict[str, Any]) -> str:
    if row["attempt_id"] is None:
        return "nobody holds the lock and no attempt is running"
    if row["lock_mode"] != "lease":
        return "nobody holds the lock: its session ended"
    if row["lease_expires_at"] is None:
        return "its lease is gone (released or taken over)"
    return f"its lease expired {row['lease_expires_at']:%Y-%m-%d %H:%M:%S %Z}, free to take over"


def problems(
    conn: psycopg.Connection,
    schema: str,
    jobs: Mapping[str, Collection[str] | None] | Collection[str],
    first: str,
    last: str,
) -> list[str]:
    """One line per gap (from ``first`` to ``last``; of each job's due keys when ``jobs``
    maps the job names to them, see :func:`gaps`) and per stale key of each job: what the
    example watch DAG logs and fails with."""
    found: list[str] = []
    due_by_job = jobs if isinstance(jobs, Mapping) else dict.fromkeys(jobs)
    for job, due in due_by_job.items():
        found += [
            f"{job} {gap.run_key}: {gap.kind}"
            for gap in gaps(conn, schema, job, first, last, due=due)
        ]
        found += [
            f"{job} {row['run_key']}: stale since {row['started_at']:%Y-%m-%d %H:%M} (attempt "
            f"{row['attempt_id']} on {row['hostname']}, {row['lock']})"
            for row in stale(conn, schema, job)
        ]
    return found
