"""Adversary of migration 0012 (a start fenced by its own lock), on real PostgreSQL.

Found: a worker of the previous release (version 11: ``fence_take_over(lock_key, wait_ms)``, the
two-argument function that 0012 keeps for a rolling upgrade) whose lock session ended before
its start still commits that start after a new worker's successor has started, and takes the
run over from it: the successor's completion was refused and the key left not completed (fixed
by migration 0013: a start's INSERT checks its lock session, whichever fence_take_over the
worker sent). Held: a start whose lock is lost after its check (it commits before the
successor's start, which closes it as abandoned); a dry run's start after its lock was lost
(LockLostError naming the step and a rerun, nothing recorded).

Adversary of migration 0013 (the start checked by a trigger on job_run_attempts). Held: a
version 7 worker's late start (the one-argument fence_take_over of migration 6) is refused
too, as LockLostError naming the start and a rerun with this code's runner; the check for lock
keys of every sign of each int4 half (the fence key compared in pg_locks as oid); a schema not
named idempotency, with the session's search_path on public where decoys of run_lock_held_by
and held_run_locks say every lock is held; the legitimate starts (normal, dry run, forced,
takeover of an abandoned key, adopt, a rolling upgrade: tests/integration/test_runner.py,
test_adopt.py, test_rolling_upgrade.py pass with the trigger); a 0.1.0 worker's start does not
hold the fence key and is not checked, which is right: 0.1.0 records its start on its lock
session itself, so a lost lock session cannot commit it. Known and left: an old worker is named
by its pid alone (a pid reused by the successor's lock session passes). Cost, measured on the
development machine (2 cores, indicative): a start (fence_take_over + start_attempt) took a
median 1.12 ms without the trigger and 1.56 ms with it; with 10,000 other locks in pg_locks
6.0 ms and 14.6 ms (the trigger reads pg_lock_status twice more per start, redundantly for a
worker of this version, whose four-argument fence_take_over already checked its holder).
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from airflow_idempotency import _sql, records
from airflow_idempotency import schema as schema_mod
from airflow_idempotency.exceptions import LockLostError
from airflow_idempotency.records import RunOptions
from airflow_idempotency.runner import run_idempotently
from support.db import rows
from support.fenced_work import late_start_race
from support.locks import Background, terminate_lock_session, wait_for, waiting_backends

JOB = "finding"
KEY = "2026-10-01"

# sql/queries.sql's fence_take_over as a worker of version 7 sends it (migration 6's function)
VERSION_7_TAKE_OVER = (
    "SELECT {schema}.fence_take_over(%(lock_key)s), "
    "{schema}.bound_dead_peer(%(keepalives_idle)s, %(keepalives_interval)s, "
    "%(keepalives_count)s, %(tcp_user_timeout)s)"
)
# sql/queries.sql's fence_take_over as a worker of version 11 sends it (before 555b3c2)
OLD_TAKE_OVER = (
    "SELECT {schema}.fence_take_over(%(lock_key)s, %(lock_wait_ms)s), "
    "{schema}.bound_dead_peer(%(keepalives_idle)s, %(keepalives_interval)s, "
    "%(keepalives_count)s, %(tcp_user_timeout)s)"
)


def test_an_old_workers_late_start_does_not_take_the_run_over_from_a_new_one(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_threads: set[int] = set()
    new_query = _sql.query

    def query(name: str, schema: str, file: str = "queries.sql") -> str:
        if name == "fence_take_over" and threading.get_ident() in old_threads:
            return OLD_TAKE_OVER.replace("{schema}", schema)
        return new_query(name, schema, file)

    monkeypatch.setattr(records, "query", query)
    # the late attempt's thread sends the old worker's take-over
    _, successor = late_start_race(
        pg_dsn, JOB, KEY, on_late_connect=lambda: old_threads.add(threading.get_ident())
    )
    assert rows(pg_dsn, "SELECT n FROM finding_rows") == [(1,)]
    assert successor.error is None, successor.error
    assert rows(pg_dsn, "SELECT status FROM idempotency.job_runs") == [("completed",)]


def test_a_version_7_workers_late_start_is_refused_too(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-argument fence_take_over of migration 6 (a worker of version 7) takes the fence
    key exclusively too: the trigger of 0013 checks its start, which is refused (with this
    code's runner: LockLostError naming the start and a rerun) and writes nothing."""
    old_threads: set[int] = set()
    new_query = _sql.query

    def query(name: str, schema: str, file: str = "queries.sql") -> str:
        if name == "fence_take_over" and threading.get_ident() in old_threads:
            return VERSION_7_TAKE_OVER.replace("{schema}", schema)
        return new_query(name, schema, file)

    monkeypatch.setattr(records, "query", query)
    late, successor = late_start_race(
        pg_dsn, JOB, KEY, on_late_connect=lambda: old_threads.add(threading.get_ident())
    )
    assert successor.error is None, successor.error
    assert isinstance(late.error, LockLostError), late.error
    message = str(late.error)
    assert "the start of" in message and "rerun" in message.lower(), message
    assert rows(pg_dsn, "SELECT n FROM finding_rows") == [(1,)]
    assert rows(pg_dsn, "SELECT status, current_attempt_id FROM idempotency.job_runs") == [
        ("completed", successor.result.attempt_id)
    ]
    assert rows(pg_dsn, "SELECT outcome FROM idempotency.job_run_attempts") == [("completed",)]


# every sign of each int4 half of the key: the fence key is (hi, lo), compared in pg_locks as oid
LOCK_KEYS = [1, -1, 2**31, -(2**31), 2**32, -(2**32), 2**63 - 1, -(2**63), 0x7FFFFFFF80000000]
START = (
    "INSERT INTO {schema}.job_run_attempts (job_name, run_key, lock_key, outcome, "
    "triggered_by, hostname, pid, lock_backend_pid) "
    "VALUES ('j', 'k', %(lock_key)s, 'running', 'manual', 'h', 1, %(pid)s)"
)


def _old_start(dsn: str, schema: str, take_over: str, lock_key: int, pid: int) -> str | None:
    """An old worker's start by hand: its take-over, then its attempt row, rolled back; the
    SQLSTATE it failed with, or None when it was accepted."""
    with psycopg.connect(dsn) as conn:
        try:
            conn.execute(take_over.format(schema=schema), {"lock_key": lock_key})
            conn.execute(START.format(schema=schema), {"lock_key": lock_key, "pid": pid})
        except psycopg.Error as exc:
            return exc.sqlstate
        finally:
            conn.rollback()
    return None


def _old_starts_checked(dsn: str, schema: str) -> list[str]:
    """For each lock key and each old take-over: the start is accepted while its lock session
    holds the run lock and refused (IF001) once the session ended; what went otherwise."""
    wrong = []
    for lock_key in LOCK_KEYS:
        for take_over in (
            "SELECT {schema}.fence_take_over(%(lock_key)s::bigint)",
            "SELECT {schema}.fence_take_over(%(lock_key)s::bigint, 1000)",
        ):
            holder = psycopg.connect(dsn, autocommit=True)
            holder.execute("SELECT pg_advisory_lock(%s::bigint)", (lock_key,))
            pid = holder.info.backend_pid
            held = _old_start(dsn, schema, take_over, lock_key, pid)
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
            holder.close()
            lost = _old_start(dsn, schema, take_over, lock_key, pid)
            if (held, lost) != (None, "IF001"):
                wrong.append(f"{lock_key} {take_over}: held {held}, lost {lost}")
    return wrong


def test_an_old_start_is_checked_for_lock_keys_of_every_sign(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        schema_mod.ensure_schema(conn, "idempotency")
    assert _old_starts_checked(pg_dsn, "idempotency") == []


def test_an_old_start_is_checked_in_another_schema_whatever_the_search_path(
    pg_dsn: str,
) -> None:
    """The bookkeeping schema named otherwise, the session's search_path on public, where a
    decoy says every run lock is held: the trigger's functions read their own schema."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        schema_mod.ensure_schema(conn, "finding_elsewhere")
        conn.execute(
            "CREATE FUNCTION public.run_lock_held_by(bigint, integer, text) RETURNS boolean "
            "LANGUAGE sql AS 'SELECT true'"
        )
        conn.execute(
            "CREATE FUNCTION public.held_run_locks() "
            "RETURNS TABLE (lock_key bigint, pid integer, holder text) "
            "LANGUAGE sql AS 'SELECT NULL::bigint, NULL::integer, NULL::text WHERE false'"
        )
    dsn = make_conninfo(pg_dsn, options="-csearch_path=public")
    assert _old_starts_checked(dsn, "finding_elsewhere") == []


def _blocked_on_a_row(dsn: str) -> bool:
    """Whether a backend of this database waits for a row lock (a transaction id)."""
    found = rows(
        dsn,
        "SELECT 1 FROM pg_locks AS l WHERE NOT l.granted AND l.locktype IN "
        "('transactionid', 'tuple') AND l.pid IS NOT NULL",
    )
    return bool(found)


def test_a_start_whose_lock_is_lost_after_its_check_commits_before_the_successors(
    pg_dsn: str,
) -> None:
    """The late start passes its check, then waits (a row lock on job_runs) while its lock
    session ends and a successor takes the lock: the successor's start waits for it, then
    closes it as abandoned; the successor completes the key."""
    with pytest.raises(RuntimeError):
        run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn),
            job_name=JOB,
            run_key=KEY,
            work=lambda run: (_ for _ in ()).throw(RuntimeError("first fails")),
        )
    blocker = psycopg.connect(pg_dsn)
    blocker.execute("SELECT 1 FROM idempotency.job_runs FOR UPDATE")
    late = Background(
        lambda: run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn),
            job_name=JOB,
            run_key=KEY,
            work=lambda run: None,
        )
    )
    wait_for("the late start's row wait", lambda: _blocked_on_a_row(pg_dsn))
    terminate_lock_session(pg_dsn, JOB, KEY)
    successor = Background(
        lambda: run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn),
            job_name=JOB,
            run_key=KEY,
            work=lambda run: {"n": 1},
        )
    )
    wait_for("the successor's start on the fence key", lambda: bool(waiting_backends(pg_dsn, 2)))
    blocker.rollback()
    blocker.close()
    late.join()
    successor.join()
    assert successor.error is None, successor.error
    assert late.error is not None
    assert rows(pg_dsn, "SELECT status, current_attempt_id FROM idempotency.job_runs") == [
        ("completed", successor.result.attempt_id)
    ]
    outcomes = rows(
        pg_dsn, "SELECT attempt_id, outcome FROM idempotency.job_run_attempts ORDER BY 1"
    )
    assert [o for _, o in outcomes] == ["failed", "lock_lost", "completed"], outcomes


def test_a_dry_runs_start_after_its_lock_was_lost_is_refused_and_writes_nothing(
    pg_dsn: str,
) -> None:
    late_start = threading.Event()
    connects = {"n": 0}

    def connect() -> psycopg.Connection[Any]:
        connects["n"] += 1
        if connects["n"] == 2:
            late_start.wait(30)
        return psycopg.connect(pg_dsn)

    late = Background(
        lambda: run_idempotently(
            connect=connect,
            job_name=JOB,
            run_key=KEY,
            work=lambda run: None,
            options=RunOptions(dry_run=True),
        )
    )
    wait_for("the dry run's lock", lambda: connects["n"] == 2)
    terminate_lock_session(pg_dsn, JOB, KEY)
    late_start.set()
    late.join()
    assert isinstance(late.error, LockLostError), late.error
    message = str(late.error)
    assert "the start of" in message and "rerun" in message.lower(), message
    assert "password" not in message.lower() and "postgresql://" not in message, message
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.job_run_attempts") == [(0,)]
