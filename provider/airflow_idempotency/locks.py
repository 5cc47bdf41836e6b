"""Session-scoped advisory locks, one per (job name, run key).

The lock key is a stable, documented function of the job name and run key::

    sha256(job_name.encode() + b"\\x1f" + run_key.encode()) -> first 8 bytes -> signed int64

taken with ``pg_try_advisory_lock(bigint)``. Postgres shows it in ``pg_locks`` as
``classid`` = high 32 bits, ``objid`` = low 32 bits, ``objsubid`` = 1. Two different keys
sharing a hash would only make them wait for each other, never run twice at once.

The lock lives on a connection dedicated to it and held for the whole run. Postgres
releases it when that session ends, including when the worker is killed.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import psycopg

from airflow_idempotency._sql import query

log = logging.getLogger(__name__)


def run_lock_key(job_name: str, run_key: str) -> int:
    """The advisory lock key of (job_name, run_key)."""
    digest = hashlib.sha256(job_name.encode() + b"\x1f" + run_key.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def split_lock_key(lock_key: int) -> tuple[int, int]:
    """The (classid, objid) pair under which ``pg_locks`` shows a bigint advisory lock."""
    unsigned = lock_key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF


@dataclass(frozen=True)
class RunLock:
    """A held run lock: its key and the backend (session) that holds it."""

    lock_key: int
    backend_pid: int

    @property
    def params(self) -> dict[str, int]:
        """Query parameters naming this lock, for the fencing checks in queries.sql."""
        hi, lo = split_lock_key(self.lock_key)
        return {"lock_hi": hi, "lock_lo": lo, "lock_backend_pid": self.backend_pid}


@dataclass(frozen=True)
class SessionSettings:
    """A session's ``search_path`` and ``application_name``, as a run found them."""

    search_path: str
    application_name: str


def open_lock_session(
    conn: psycopg.Connection, lock_key: int, *, schema: str, application_name: str
) -> tuple[RunLock | None, SessionSettings]:
    """Try the lock on ``conn`` and point the session at ``schema``, in one round trip.

    Returns the lock (``None`` when another session holds it) and the settings it replaced,
    for :func:`close_lock_session`. ``schema`` must already be validated.
    """
    row = conn.execute(
        query("open_lock_session"),
        {"lock_key": lock_key, "schema": schema, "application_name": application_name},
    ).fetchone()
    assert row is not None
    acquired, backend_pid, search_path, previous_name = row[:4]
    lock = RunLock(lock_key, backend_pid) if acquired else None
    return lock, SessionSettings(search_path, previous_name)


def close_lock_session(
    conn: psycopg.Connection, lock_key: int, lock: RunLock | None, previous: SessionSettings
) -> None:
    """Release ``lock`` (if held) and restore the session's settings, in one round trip.

    Logs, never raises: a session that is gone released its lock with it.
    """
    if conn.closed or conn.broken:
        return
    params = {
        "acquired": lock is not None,
        "lock_key": lock_key,
        "search_path": previous.search_path,
        "application_name": previous.application_name,
    }
    try:
        row = conn.execute(query("close_lock_session"), params).fetchone()
    except psycopg.Error as exc:
        log.warning("could not release run lock %s: %s", lock_key, exc)
        return
    if lock is not None and not (row and row[0]):
        log.warning("run lock %s was not held by this session when releasing it", lock_key)


def try_acquire_run_lock(conn: psycopg.Connection, lock_key: int) -> RunLock | None:
    """Take the lock on ``conn`` without waiting; ``None`` when another session holds it."""
    row = conn.execute(query("try_lock"), {"lock_key": lock_key}).fetchone()
    assert row is not None
    acquired, backend_pid = row
    return RunLock(lock_key, backend_pid) if acquired else None


def release_run_lock(conn: psycopg.Connection, lock: RunLock) -> None:
    """Release ``lock``; log (do not raise) when the session no longer held it."""
    if conn.closed or conn.broken:
        return  # the session is gone, and Postgres released the lock with it
    try:
        row = conn.execute(query("unlock"), {"lock_key": lock.lock_key}).fetchone()
    except psycopg.Error as exc:
        log.warning("could not release run lock %s: %s", lock.lock_key, exc)
        return
    if not row or not row[0]:
        log.warning("run lock %s was not held by this session when releasing it", lock.lock_key)


def lock_is_held(conn: psycopg.Connection, lock: RunLock) -> bool:
    """Whether ``lock`` is still held by the session that took it (checked from any session)."""
    row = conn.execute(query("lock_is_held_by"), lock.params).fetchone()
    return bool(row and row[0])
