"""The stack's metadata database, read straight: runs, task instances, backfills, heartbeats.

SQLite (read-only, WAL mode) by default, PostgreSQL when the stack has a ``metadata_dsn``; the
queries use ``?`` placeholders and rows are addressable by position and by column name on
both. An ``airflow`` CLI call costs ~4 s of imports, a query a millisecond. The only writes
are the ones the scheduler would do itself after a timer (a backfill marked complete).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg

TERMINAL_RUN_STATES = frozenset({"success", "failed"})
TERMINAL_TI_STATES = frozenset({"success", "failed", "skipped", "upstream_failed", "removed"})
NOW = object()  # a parameter of MetadataDB._write: the current time


@dataclass(frozen=True)
class RunResult:
    """One DAG run, as stored in the metadata DB."""

    run_id: str
    logical_date: datetime | None
    state: str | None
    run_type: str
    backfill_id: int | None = None
    clear_number: int = 0
    conf: dict[str, Any] | None = None


@dataclass(frozen=True)
class TaskInstanceResult:
    """One task instance of a run (try_number counts every attempt, also after a clear)."""

    task_id: str
    map_index: int
    state: str | None
    try_number: int
    max_tries: int


@dataclass(frozen=True)
class BackfillEntry:
    """One date of a backfill: a run created or cleared, or the reason it was skipped."""

    logical_date: datetime | None
    run_id: str | None
    state: str | None
    exception_reason: str | None


def parse_ts(value: Any) -> datetime | None:
    """A timestamp of the metadata DB (SQLite text or a datetime) as an aware datetime."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    parsed = datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


class _Row(tuple[Any, ...]):
    """A row of a PostgreSQL query addressable like sqlite3.Row: ``row[0]``, ``row["name"]``."""

    names: dict[str, int]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return super().__getitem__(self.names[key])
        return super().__getitem__(key)


def _name_and_index_rows(cursor: psycopg.Cursor[Any]) -> Callable[[Sequence[Any]], _Row]:
    names = {c.name: i for i, c in enumerate(cursor.description or ())}

    def make(values: Sequence[Any]) -> _Row:
        row = _Row(values)
        row.names = names
        return row

    return make


def _now_db() -> str:
    """Now, in the format Airflow's UtcDateTime stores in SQLite."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")


class MetadataDB:
    """Airflow's metadata database at ``db_path`` (SQLite), or ``metadata_dsn`` if given."""

    def __init__(self, db_path: Path, metadata_dsn: str | None = None) -> None:
        self.db_path = db_path
        self.metadata_dsn = metadata_dsn

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        """Run a read-only query on the metadata DB (``?`` placeholders); rows are indexed
        by position and by column name, on SQLite and on PostgreSQL alike."""
        if self.metadata_dsn is not None:
            with psycopg.connect(self.metadata_dsn, row_factory=_name_and_index_rows) as conn:
                conn.read_only = True
                return conn.execute(sql.replace("?", "%s"), params).fetchall()
        uri = f"file:{self.db_path}?mode=ro"
        with closing(sqlite3.connect(uri, uri=True, timeout=30)) as lite:
            lite.row_factory = sqlite3.Row
            return list(lite.execute(sql, params))

    def _query_one(self, sql: str, params: Sequence[Any] = ()) -> Any:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def _write(self, sql: str, params: Sequence[Any]) -> None:
        """One write to the metadata DB (``?`` placeholders; ``NOW`` for the current time)."""
        if self.metadata_dsn is not None:
            values = [datetime.now(timezone.utc) if p is NOW else p for p in params]
            with psycopg.connect(self.metadata_dsn) as conn:
                conn.execute(sql.replace("?", "%s"), values)
            return
        values = [_now_db() if p is NOW else p for p in params]
        with closing(sqlite3.connect(self.db_path, timeout=30)) as lite, lite:
            lite.execute(sql, values)

    @staticmethod
    def _run(row: Any) -> RunResult:
        conf = row["conf"]
        if isinstance(conf, bytes | str) and conf:
            try:
                conf = json.loads(conf)
            except ValueError:
                conf = None  # older schemas pickled conf
        return RunResult(
            run_id=row["run_id"],
            logical_date=parse_ts(row["logical_date"]),
            state=row["state"],
            run_type=row["run_type"],
            backfill_id=row["backfill_id"],
            clear_number=row["clear_number"] or 0,
            conf=conf if isinstance(conf, dict) else None,
        )

    def dag_runs(self, dag_id: str) -> list[RunResult]:
        """All runs of ``dag_id``, oldest logical date first (runs without one last)."""
        rows = self.query(
            "SELECT run_id, logical_date, state, run_type, backfill_id, clear_number, conf "
            "FROM dag_run WHERE dag_id = ? ORDER BY logical_date IS NULL, logical_date, id",
            (dag_id,),
        )
        return [self._run(r) for r in rows]

    def dag_run(self, dag_id: str, run_id: str) -> RunResult | None:
        row = self._query_one(
            "SELECT run_id, logical_date, state, run_type, backfill_id, clear_number, conf "
            "FROM dag_run WHERE dag_id = ? AND run_id = ?",
            (dag_id, run_id),
        )
        return self._run(row) if row else None

    def task_instances(self, dag_id: str, run_id: str) -> list[TaskInstanceResult]:
        """The task instances of one run, by task_id and map_index."""
        rows = self.query(
            "SELECT task_id, map_index, state, try_number, max_tries FROM task_instance "
            "WHERE dag_id = ? AND run_id = ? ORDER BY task_id, map_index",
            (dag_id, run_id),
        )
        return [
            TaskInstanceResult(
                r["task_id"], r["map_index"], r["state"], r["try_number"], r["max_tries"]
            )
            for r in rows
        ]

    def describe_runs(self, dag_id: str, run_ids: Sequence[str]) -> str:
        """Human-readable states of some runs and their task instances (for error messages)."""
        out = []
        for run_id in run_ids:
            run = self.dag_run(dag_id, run_id)
            tis = ", ".join(
                f"{t.task_id}={t.state}(try {t.try_number})"
                for t in self.task_instances(dag_id, run_id)
            )
            out.append(f"  {run_id}: {run.state if run else 'missing'} [{tis}]")
        return "runs:\n" + "\n".join(out)

    def import_errors(self) -> list[tuple[str, str]]:
        """(filename, stacktrace) of every DAG file that failed to parse."""
        return [(r["filename"], r["stacktrace"]) for r in self.query("SELECT * FROM import_error")]

    def scheduler_heartbeat(self) -> datetime | None:
        """The latest heartbeat of a running scheduler, None before the first."""
        row = self._query_one(
            "SELECT max(latest_heartbeat) FROM job WHERE job_type = 'SchedulerJob' "
            "AND state = 'running'"
        )
        return parse_ts(row[0]) if row else None

    # ---------------------------------------------------------------- backfills

    def backfill_entries(self, backfill_id: int) -> list[BackfillEntry]:
        """Every date of a backfill, in order: its run, or why no run was created."""
        rows = self.query(
            "SELECT b.logical_date AS bdate, b.exception_reason, r.run_id, r.state "
            "FROM backfill_dag_run b LEFT JOIN dag_run r ON r.id = b.dag_run_id "
            "WHERE b.backfill_id = ? ORDER BY b.sort_ordinal",
            (backfill_id,),
        )
        return [
            BackfillEntry(parse_ts(r["bdate"]), r["run_id"], r["state"], r["exception_reason"])
            for r in rows
        ]

    def backfill_runs(self, backfill_id: int) -> list[RunResult]:
        """The runs a backfill created or cleared, in the backfill's order."""
        rows = self.query(
            "SELECT r.run_id, r.logical_date, r.state, r.run_type, r.backfill_id, "
            "r.clear_number, r.conf FROM backfill_dag_run b JOIN dag_run r ON r.id = b.dag_run_id "
            "WHERE b.backfill_id = ? ORDER BY b.sort_ordinal",
            (backfill_id,),
        )
        return [self._run(r) for r in rows]

    def latest_backfill_id(self, dag_id: str) -> int | None:
        row = self._query_one("SELECT max(id) FROM backfill WHERE dag_id = ?", (dag_id,))
        return row[0] if row else None

    def mark_backfill_complete(self, backfill_id: int) -> None:
        """What SchedulerJobRunner._mark_backfills_complete does, without its 30 s timer."""
        self._write(
            "UPDATE backfill SET completed_at = ? WHERE id = ? AND completed_at IS NULL "
            "AND NOT EXISTS (SELECT 1 FROM dag_run WHERE backfill_id = ? "
            "AND state IN ('running', 'queued'))",
            (NOW, backfill_id, backfill_id),
        )

    def half_made_backfill(self, dag_id: str, after_id: int) -> int | None:
        """An active backfill newer than ``after_id`` (only a failed attempt made it). One
        with no runs is marked complete here, as the scheduler does after 2 minutes."""
        self._complete_orphan_backfills(dag_id, after_id)
        row = self._query_one(
            "SELECT max(id) FROM backfill WHERE dag_id = ? AND id > ? AND completed_at IS NULL",
            (dag_id, after_id),
        )
        return row[0] if row and row[0] is not None else None

    def _complete_orphan_backfills(self, dag_id: str, after_id: int) -> None:
        """Mark backfills newer than ``after_id`` that got no run rows complete (as the
        scheduler does after 2 minutes)."""
        self._write(
            "UPDATE backfill SET completed_at = ? WHERE dag_id = ? AND id > ? "
            "AND completed_at IS NULL AND NOT EXISTS "
            "(SELECT 1 FROM backfill_dag_run b WHERE b.backfill_id = backfill.id)",
            (NOW, dag_id, after_id),
        )
