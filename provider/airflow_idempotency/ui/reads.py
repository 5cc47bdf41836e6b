"""What the Run keys view reads, for one reader: Airflow-free, read-only, one snapshot a page.

:class:`RecordsReader` runs the ``ui_*`` statements of ``sql/queries.sql`` (and the CLI's
read-only ones) on a connection to the job database. Each page is read in one transaction
``REPEATABLE READ, READ ONLY`` with a statement timeout: its parts agree with each other,
Postgres itself refuses any write, and a slow statement cannot hold an api-server thread.

What a reader may see is a :class:`Visibility`: every DAG, or the DAG ids the auth manager
authorizes. It is applied in SQL, so rows of other DAGs never leave the database.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg

from airflow_idempotency._sql import query_rows
from airflow_idempotency.exceptions import InvalidRunKeyError
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.run_key import Period, RunKeyRule, key_parts, segment_template
from airflow_idempotency.ui import calendar

STATEMENT_TIMEOUT = "15s"
"""Upper bound of one statement of a page (a page reads through indexes in milliseconds)."""

RUNS_PAGE = 50
ATTENTION_LIMIT = 20
UNCONFIRMED_LIMIT = 20
DAG_KEYS_PAGE = 30
DAG_JOBS_LIMIT = 40
RUN_ATTEMPTS_LIMIT = 500
KEY_ATTEMPTS_LIMIT = 200
KEY_EFFECTS_LIMIT = 50
JOBS_LIMIT = 200

Row = dict[str, Any]


@dataclass(frozen=True)
class Visibility:
    """Which records a reader may see: those of every DAG, or of the DAG ids listed.

    Records written outside Airflow (no DAG id) are visible only with ``all_dags``.
    """

    all_dags: bool
    dag_ids: frozenset[str] = frozenset()

    def can_read(self, dag_id: str | None) -> bool:
        """Whether a record carrying ``dag_id`` is visible."""
        return self.all_dags or (dag_id is not None and dag_id in self.dag_ids)

    @property
    def params(self) -> dict[str, Any]:
        """The query parameters every ``ui_*`` statement takes."""
        return {"all_dags": self.all_dags, "dag_ids": [] if self.all_dags else sorted(self.dag_ids)}


@dataclass(frozen=True)
class RunFilters:
    """Optional filters of the run-key list (None: any)."""

    job: str | None = None
    status: str | None = None
    dag_id: str | None = None
    from_key: str | None = None
    to_key: str | None = None

    @property
    def active(self) -> bool:
        return any(
            v is not None for v in (self.job, self.status, self.dag_id, self.from_key, self.to_key)
        )


@dataclass
class Overview:
    """The overview page: what needs attention, what runs now, and the run keys."""

    attention: list[Row]
    counts: dict[str, int]
    locks: list[Row]
    unconfirmed: list[Row]
    runs: list[Row]
    next_page: tuple[str, str] | None
    jobs: list[Row] = field(default_factory=list)
    remotes: list[Row] = field(default_factory=list)
    """Per remote system: its effects not confirmed (pending, failed) and the keys they are of."""


@dataclass
class DagKeys:
    """A DAG's tab: its jobs (columns) and, per run key (rows), each job's record."""

    dag_id: str
    jobs: list[str]
    keys: list[tuple[str, dict[str, Row]]]
    next_before: str | None


@dataclass
class RunAttempts:
    """A DAG run's tab: what each of its tasks did, attempt by attempt."""

    dag_id: str
    run_id: str
    task_id: str | None
    attempts: list[Row]


@dataclass
class KeyDetail:
    """One (job, run key): its record, who holds its lock now (a session, or a lease), its
    attempts and effects."""

    job_name: str
    run_key: str
    run: Row | None
    lock_holder: Row | None
    attempts: list[Row]
    attempts_total: int
    attempts_hidden: int
    effects: list[Row]
    unconfirmed: list[Row] = field(default_factory=list)
    lease: Row | None = None
    """The key's lease (the lease mode), live or expired (``live``), or None."""


@dataclass
class Calendar:
    """A job's business periods in a window, laid out in rows (:mod:`.calendar`).

    ``period`` is None when the job's newest key names no period (a key from a custom
    rule): there is no calendar then. Each cell is None where the row has no period in the
    window, else the period's ``run_key`` and ``state``: completed, failed, running (started,
    its lock held now), interrupted (started, nobody holds the lock), locked (held now, no
    record yet), missing (no record, between the job's first and newest key) or none (no
    record, outside them); with its record's fields when it has one.
    """

    job_name: str
    period: Period | None
    first_key: str | None
    last_key: str | None
    from_key: str | None = None
    to_key: str | None = None
    columns: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    earlier: tuple[str, str] | None = None
    later: tuple[str, str] | None = None
    other_keys: int = 0
    segment: str | None = None  # a segmented job's calendar is one segment's (eu|...)
    segments: list[str] = field(default_factory=list)  # the job's segments, to switch


CALENDAR_STATES = ("completed", "failed", "running", "interrupted", "locked", "missing")


def run_state(row: Row) -> str:
    """The state a job_runs row is in now: completed, failed, running (its lock is held) or
    interrupted (started, and nobody holds its lock: the worker died; the next run of the
    key takes it over)."""
    if row["status"] == "started":
        return "running" if row.get("locked") else "interrupted"
    return str(row["status"])


def _with_state(rows: list[Row]) -> list[Row]:
    for row in rows:
        row["state"] = run_state(row)
    return rows


class RecordsReader:
    """The view's reads on one connection to the job database (autocommit, idle).

    :param conn: a connection opened with ``autocommit=True`` (and, behind a pooler,
        ``prepare_threshold=None``); it is only read.
    :param schema: the bookkeeping schema, validated by the caller.
    :param visibility: what this reader may see.
    """

    def __init__(self, conn: psycopg.Connection, schema: str, visibility: Visibility) -> None:
        self.conn = conn
        self.schema = schema
        self.visibility = visibility

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """One read-only transaction for a page: BEGIN and its timeout in one round trip."""
        with self.conn.pipeline():
            self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            self.conn.execute(
                "SELECT set_config('statement_timeout', %(timeout)s, true)",
                {"timeout": STATEMENT_TIMEOUT},
            )
        try:
            yield
        finally:
            if not self.conn.broken and not self.conn.closed:
                self.conn.execute("ROLLBACK")  # read only: nothing to commit

    def _rows(self, name: str, **params: Any) -> list[Row]:
        return query_rows(self.conn, name, self.schema, {**self.visibility.params, **params})

    # -- pages -----------------------------------------------------------------------------

    def overview(
        self, filters: RunFilters, before: tuple[str, str] | None = None, limit: int = RUNS_PAGE
    ) -> Overview:
        """The overview: open runs (with counts), held locks, unconfirmed effects, run keys."""
        with self.snapshot():
            attention = _with_state(self._rows("ui_attention", limit=ATTENTION_LIMIT))
            locks = self._rows("ui_locks")
            unconfirmed = self._rows("ui_unconfirmed", limit=UNCONFIRMED_LIMIT)
            remotes = self._rows("ui_unconfirmed_by_remote")
            runs = self._runs(filters, before, limit)
            jobs = self._rows("ui_jobs", limit=JOBS_LIMIT)
            open_by_job = {row.pop("job_name"): row for row in self._rows("ui_open_by_job")}
        locked: dict[str, int] = {}
        for lock in locks:
            locked[lock["job_name"]] = locked.get(lock["job_name"], 0) + 1
        for job in jobs:
            job.update(
                open_by_job.get(job["job_name"], {"failed": 0, "running": 0, "interrupted": 0})
            )
            job["locked"] = locked.get(job["job_name"], 0)
        # The page's totals are the per-job counts summed (one statement, one snapshot).
        counts = {
            name: sum(int(row[name]) for row in open_by_job.values())
            for name in ("failed", "running", "interrupted")
        }
        for row in attention:
            del row["lock_key"]
        return Overview(attention, counts, locks, unconfirmed, *runs, jobs=jobs, remotes=remotes)

    def locks(self) -> list[Row]:
        """The run locks held now, oldest attempt first, with their holder and age."""
        with self.snapshot():
            return self._rows("ui_locks")

    def calendar(
        self,
        job_name: str,
        from_key: str | None = None,
        to_key: str | None = None,
        segment: str | None = None,
    ) -> Calendar | None:
        """A job's periods from ``from_key`` to ``to_key`` (both or neither: by default the
        newest periods, :data:`.calendar.DEFAULT_ROWS` rows), or None if the reader may see
        no record of the job. A malformed or too long range raises InvalidInputError.

        A job with segmented keys (``eu|2026-10-01``) has a calendar per segment: ``segment``
        (``eu``), by default its newest key's; ``from_key`` and ``to_key`` are periods then.
        """
        if (from_key is None) != (to_key is None):
            raise InvalidRunKeyError("give both from and to (run keys), or neither")
        with self.snapshot():
            (bounds,) = self._rows("ui_job_bounds", job=job_name)
            if bounds["last_key"] is None:
                return None
            found_segments = self._rows("ui_job_segments", job=job_name)
            segments = [r["prefix"].rstrip("|") for r in found_segments]
            try:
                prefix = _segment_prefix(segment, bounds["last_key"])
            except InvalidRunKeyError:
                if segment:
                    raise
                last = bounds["last_key"]
                return Calendar(job_name, None, bounds["first_key"], last, segments=segments)
            if prefix:
                (bounds,) = self._rows("ui_job_segment_bounds", job=job_name, prefix=prefix)
                if bounds["last_key"] is None:
                    raise InvalidRunKeyError(f"job {job_name!r} has no key of segment {segment!r}")
            first = bounds["first_key"].removeprefix(prefix)
            last = bounds["last_key"].removeprefix(prefix)
            try:
                period = RunKeyRule.for_key(last).period
            except InvalidRunKeyError:
                return Calendar(job_name, None, first, last, segments=segments)
            if from_key is None or to_key is None:
                window = calendar.default_window(period, last)
            else:
                window = calendar.window(period, from_key, to_key)
            records = self._rows(
                "ui_job_calendar",
                job=job_name,
                from_key=prefix + window.from_key,
                to_key=prefix + window.to_key,
                limit=window.rows * 62,
            )
            held = [lock for lock in self._rows("ui_locks") if lock["job_name"] == job_name]
        if prefix:  # the grid is of periods; each cell links its full key
            records = [r | {"run_key": r["run_key"].removeprefix(prefix)} for r in records]
            held = [h | {"run_key": h["run_key"].removeprefix(prefix)} for h in held]
        return _with_segment(
            _calendar_of(job_name, first, last, window, records, held), prefix, segments
        )

    def runs(
        self, filters: RunFilters, before: tuple[str, str] | None = None, limit: int = RUNS_PAGE
    ) -> tuple[list[Row], tuple[str, str] | None]:
        """One page of run keys, newest first, and where the next page starts (or None)."""
        with self.snapshot():
            return self._runs(filters, before, limit)

    def _runs(
        self, filters: RunFilters, before: tuple[str, str] | None, limit: int
    ) -> tuple[list[Row], tuple[str, str] | None]:
        rows = self._rows(
            "ui_runs",
            job=filters.job,
            status=filters.status,
            dag_id=filters.dag_id,
            from_key=filters.from_key,
            to_key=filters.to_key,
            before_key=before[0] if before else None,
            before_job=before[1] if before else None,
            limit=limit + 1,
        )
        more = len(rows) > limit
        rows = _with_state(rows[:limit])
        last = rows[-1] if rows else None
        return rows, (last["run_key"], last["job_name"]) if more and last else None

    def dag_keys(
        self, dag_id: str, before_key: str | None = None, limit: int = DAG_KEYS_PAGE
    ) -> DagKeys:
        """The run keys of the jobs ``dag_id`` ran, newest first: a grid of run key x job."""
        with self.snapshot():
            jobs = [
                r["job_name"]
                for r in self._rows("ui_dag_jobs", dag_id=dag_id, limit=DAG_JOBS_LIMIT)
            ]
            rows = (
                self._rows("ui_dag_keys", jobs=jobs, before_key=before_key, limit=limit + 1)
                if jobs
                else []
            )
        by_key: dict[str, dict[str, Row]] = {}
        for row in _with_state(rows):
            by_key.setdefault(row["run_key"], {})[row["job_name"]] = row
        keys = list(by_key.items())
        more = len(keys) > limit
        keys = keys[:limit]
        return DagKeys(dag_id, jobs, keys, keys[-1][0] if more and keys else None)

    def run_attempts(self, dag_id: str, run_id: str, task_id: str | None = None) -> RunAttempts:
        """The attempts of one DAG run (optionally of one task), with each key's state."""
        with self.snapshot():
            rows = self._rows(
                "ui_run_attempts",
                dag_id=dag_id,
                run_id=run_id,
                task_id=task_id,
                limit=RUN_ATTEMPTS_LIMIT,
            )
        for row in rows:
            if row["key_status"] is not None:
                row["key_state"] = run_state(
                    {"status": row["key_status"], "locked": row["key_locked"]}
                )
        return RunAttempts(dag_id, run_id, task_id, rows)

    def key(self, job_name: str, run_key: str) -> KeyDetail | None:
        """Everything about one (job, run key), or None if the reader may see none of it."""
        params = {"job": job_name, "run_key": run_key}
        with self.snapshot():
            runs = self._rows("get_run", job_name=job_name, run_key=run_key)
            attempts = self._rows("ui_key_attempts", limit=KEY_ATTEMPTS_LIMIT, **params)
            run = runs[0] if runs else None
            if run is not None and not self.visibility.can_read(run["dag_id"]):
                return None
            if run is None and not attempts:
                return None
            lock_key = run_lock_key(job_name, run_key)
            holders = self._rows("run_lock_holder", lock_key=lock_key)
            leases = self._rows("ui_key_lease", lock_key=lock_key)
            effects = self._rows("cli_ledger_summary", all=True, **params)
            unconfirmed = self._rows("cli_ledger_problems", limit=KEY_EFFECTS_LIMIT, **params)
        if run is not None:
            run["locked"] = bool(holders) or any(lease["live"] for lease in leases)
            run["state"] = run_state(run)
        first = attempts[0] if attempts else {}
        total, hidden = int(first.get("visible_total") or 0), int(first.get("hidden_total") or 0)
        for row in attempts:
            row.pop("visible_total", None)
            row.pop("hidden_total", None)
        return KeyDetail(
            job_name=job_name,
            run_key=run_key,
            run=run,
            lock_holder=holders[0] if holders else None,
            attempts=attempts,
            attempts_total=total,
            attempts_hidden=hidden,
            effects=effects,
            unconfirmed=unconfirmed,
            lease=leases[0] if leases else None,
        )


def _with_segment(found: Calendar, prefix: str, segments: list[str]) -> Calendar:
    """The calendar of one segment: each cell names its period and links its full key."""
    for row in found.rows:
        for cell in row["cells"]:
            if cell is not None:
                cell["period"], cell["run_key"] = cell["run_key"], prefix + cell["run_key"]
    found.segment = prefix.rstrip("|") or None
    found.segments = segments
    return found


def _segment_prefix(segment: str | None, last_key: str) -> str:
    """The labels before the period of a segment's keys (``eu|``), ``""`` for plain keys:
    ``segment`` as given, else the newest key's. A calendar has the period last."""
    template = segment_template(segment).template if segment else key_parts(last_key).template
    if template == ("{}",) or "{}" not in template:
        return ""
    if template[-1] != "{}":
        raise InvalidRunKeyError(
            f"segment {segment or last_key!r}: a calendar shows keys whose period comes last "
            "(eu|2026-10-01)"
        )
    return "".join(f"{label}|" for label in template[:-1])


def _calendar_of(
    job_name: str,
    first: str,
    last: str,
    window: calendar.Window,
    records: list[Row],
    held: list[Row],
) -> Calendar:
    by_key = {row["run_key"]: row for row in records}
    locked = {lock["run_key"] for lock in held}
    counts = dict.fromkeys(CALENDAR_STATES, 0)
    totals: dict[str, float] = {}
    shown: set[str] = set()
    rows = []
    for label, keys in window.grid():
        cells: list[Row | None] = []
        for key in keys:
            if key is None:
                cells.append(None)
                continue
            record = by_key.get(key)
            if record is not None:
                record["locked"] = bool(record["locked"]) or key in locked
                record["state"] = run_state(record)
                cell = record  # the record itself, not a copy: a calendar has ~1,000 cells
                shown.add(key)
                if cell["state"] == "completed" and isinstance(record["details"], dict):
                    for name, value in record["details"].items():
                        if isinstance(value, int | float) and not isinstance(value, bool):
                            totals[name] = totals.get(name, 0) + value
            elif key in locked:
                cell = {"run_key": key, "state": "locked", "locked": True}
            else:
                state = "missing" if first <= key <= last else "none"
                cell = {"run_key": key, "state": state, "locked": False}
            if cell["state"] in counts:
                counts[cell["state"]] += 1
            cells.append(cell)
        rows.append({"label": label, "cells": cells})
    earlier = window.shifted(-window.rows) if window.from_key > first else None
    later = window.shifted(window.rows) if window.to_key < last else None
    return Calendar(
        job_name=job_name,
        period=window.period,
        first_key=first,
        last_key=last,
        from_key=window.from_key,
        to_key=window.to_key,
        columns=calendar.columns(window.period),
        rows=rows,
        counts=counts,
        totals=totals,
        earlier=(earlier.from_key, earlier.to_key) if earlier else None,
        later=(later.from_key, later.to_key) if later else None,
        other_keys=len(set(by_key) - shown),
    )
