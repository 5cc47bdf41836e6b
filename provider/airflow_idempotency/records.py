"""The durable run records: ``job_runs`` (one row per job and run key) and
``job_run_attempts`` (one row per execution, whatever it did).

All functions take the bookkeeping ``schema`` (validated by the caller); every statement
names its tables with it, so no connection's search_path matters.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from airflow_idempotency._sql import query
from airflow_idempotency.locks import RunLock

_HOSTNAME = socket.gethostname()

RunStatus = Literal["started", "completed", "failed"]
AttemptOutcome = Literal[
    "running", "completed", "failed", "noop", "lock_held", "dry_run", "lock_lost", "reset"
]


@dataclass(frozen=True)
class Trigger:
    """Who or what started an execution, and the Airflow ids it ran under."""

    triggered_by: str = "unknown"  # scheduled | manual | backfill | asset-triggered | cli | ...
    triggering_user: str | None = None
    dag_id: str | None = None
    run_id: str | None = None
    task_id: str | None = None
    try_number: int | None = None
    map_index: int | None = None
    partition_key: str | None = None  # the run's Airflow partition key (3.2+): details


@dataclass(frozen=True)
class RunRecord:
    """A row of ``job_runs``."""

    job_name: str
    run_key: str
    status: RunStatus
    triggered_by: str
    triggering_user: str | None
    dag_id: str | None
    run_id: str | None
    task_id: str | None
    attempt_count: int
    current_attempt_id: int | None
    started_at: dt.datetime
    completed_at: dt.datetime | None
    updated_at: dt.datetime
    details: dict[str, Any] = field(default_factory=dict)


def get_run(conn: psycopg.Connection, schema: str, job_name: str, run_key: str) -> RunRecord | None:
    """The ``job_runs`` row of (job_name, run_key), if any."""
    with conn.cursor(row_factory=dict_row) as cur:
        params = {"job_name": job_name, "run_key": run_key}
        return run_record(cur.execute(query("get_run", schema), params).fetchone())


def run_record(row: dict[str, Any] | None) -> RunRecord | None:
    """A row of the ``get_run`` query (a dict row) as a :class:`RunRecord`."""
    return RunRecord(**row) if row else None


def _attempt_params(
    job_name: str, run_key: str, lock_key: int, trigger: Trigger, lock: RunLock | None, force: bool
) -> dict[str, Any]:
    """The columns every attempt row gets: who, which key, which worker, which lock session."""
    return {
        "job_name": job_name,
        "run_key": run_key,
        "lock_key": lock_key,
        "triggered_by": trigger.triggered_by,
        "triggering_user": trigger.triggering_user,
        "dag_id": trigger.dag_id,
        "run_id": trigger.run_id,
        "task_id": trigger.task_id,
        "try_number": trigger.try_number,
        "map_index": trigger.map_index,
        # Facts of the trigger that have no column: the attempt's details from its start.
        "trigger_details": Jsonb(
            {"partition_key": trigger.partition_key} if trigger.partition_key else {}
        ),
        "hostname": _HOSTNAME,
        "pid": os.getpid(),
        "lock_backend_pid": lock.backend_pid if lock else None,
        "force": force,
    }


def insert_attempt(
    conn: psycopg.Connection,
    schema: str,
    *,
    job_name: str,
    run_key: str,
    lock_key: int,
    outcome: AttemptOutcome,
    trigger: Trigger,
    lock: RunLock | None,
    force: bool = False,
    dry_run: bool = False,
    error: str | None = None,
    details: dict[str, Any] | None = None,
    and_commit: bool = False,
) -> int:
    """Record one execution; an outcome other than ``running`` is recorded as finished.

    ``and_commit`` sends ``COMMIT`` in the same round trip (ending the caller's
    transaction: the lock transaction of a no-op or a refused run).
    """
    params = _attempt_params(job_name, run_key, lock_key, trigger, lock, force)
    params.update(outcome=outcome, dry_run=dry_run, error=error, details=Jsonb(details or {}))
    row = _execute(conn, query("insert_attempt", schema), params, and_commit).fetchone()
    assert row is not None
    return int(row[0])


def _execute(
    conn: psycopg.Connection, statement: str, params: dict[str, Any], and_commit: bool
) -> psycopg.Cursor[Any]:
    """Run ``statement``, and with ``and_commit`` a COMMIT after it, in one round trip."""
    if not and_commit:
        return conn.execute(statement, params)
    with conn.pipeline():
        cursor = conn.execute(statement, params)
        conn.execute("COMMIT")
    return cursor


def start_attempt(
    conn: psycopg.Connection,
    schema: str,
    *,
    job_name: str,
    run_key: str,
    lock_key: int,
    trigger: Trigger,
    lock: RunLock,
    force: bool = False,
) -> tuple[int, int, int]:
    """Record a running attempt and mark (job_name, run_key) started by it, in one statement.

    Any other attempt of the key still marked running is closed as abandoned (the caller
    holds the lock, so its worker died). Returns (attempt id, attempt count of the key,
    attempts closed as abandoned).
    """
    params = _attempt_params(job_name, run_key, lock_key, trigger, lock, force)
    row = conn.execute(query("start_attempt", schema), params).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def finish_attempt(
    conn: psycopg.Connection,
    schema: str,
    attempt_id: int,
    outcome: AttemptOutcome,
    *,
    error: str | None = None,
    details: dict[str, Any] | None = None,
) -> None:
    """Record how an execution ended."""
    conn.execute(
        query("finish_attempt", schema),
        {
            "attempt_id": attempt_id,
            "outcome": outcome,
            "error": error,
            "details": Jsonb(details or {}),
        },
    )


def complete_attempt(
    conn: psycopg.Connection,
    schema: str,
    *,
    job_name: str,
    run_key: str,
    attempt_id: int,
    lock: RunLock,
    counts: dict[str, Any],
    and_commit: bool = False,
) -> bool:
    """Mark the run and the attempt completed; ``False`` (nothing written) when this attempt
    no longer owns the run or its lock.

    Must run in the lock transaction, on the lock connection: the statement checks that
    this very session still holds the advisory lock (fencing). Its COMMIT (``and_commit``:
    in the same round trip) records the completion and releases the lock at one instant.
    """
    params = {
        "job_name": job_name,
        "run_key": run_key,
        "attempt_id": attempt_id,
        "details": Jsonb(counts),
        **lock.params,
    }
    cursor = _execute(conn, query("complete_attempt", schema), params, and_commit)
    return cursor.fetchone() is not None


def mark_failed(
    conn: psycopg.Connection,
    schema: str,
    *,
    job_name: str,
    run_key: str,
    attempt_id: int,
    error: str,
) -> bool:
    """Mark the run failed, if ``attempt_id`` still owns it."""
    params = {"job_name": job_name, "run_key": run_key, "attempt_id": attempt_id, "error": error}
    return conn.execute(query("mark_failed", schema), params).fetchone() is not None
