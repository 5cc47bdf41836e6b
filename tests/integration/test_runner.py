"""The idempotent-run contract against a real PostgreSQL server (no Airflow involved)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from airflow_idempotency import schema as schema_mod
from airflow_idempotency.exceptions import LockLostError, RunLockedError, SchemaTooNewError
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.run_context import RunEnvironment
from airflow_idempotency.runner import RunContext, RunOptions, RunOutcome, run_idempotently
from support.db import rows
from support.locks import advisory_locks, run_lock_holder, terminate_lock_session


def connect_to(dsn: str) -> Callable[[], psycopg.Connection[Any]]:
    return lambda: psycopg.connect(dsn)


def fail(ctx: RunContext) -> None:
    """A work that fails (ZeroDivisionError)."""
    raise ZeroDivisionError("the work failed")


def test_quotes_and_unicode_round_trip(pg_dsn: str) -> None:
    """Job names and run keys with quotes, SQL and unicode are stored and read back verbatim."""
    job = "O'Brien's \"finance\"; DROP TABLE job_runs; -- ✓"
    key = "période-2026'10 ☃"
    result = run_idempotently(
        connect=connect_to(pg_dsn), job_name=job, run_key=key, work=lambda ctx: {"ok": 1}
    )
    assert result.outcome is RunOutcome.COMPLETED
    assert rows(pg_dsn, "SELECT job_name, run_key, status FROM idempotency.job_runs") == [
        (job, key, "completed")
    ]
    again = run_idempotently(
        connect=connect_to(pg_dsn), job_name=job, run_key=key, work=lambda ctx: {"ok": 2}
    )
    assert again.outcome is RunOutcome.NOOP


def test_completed_key_is_a_noop_and_recorded(pg_dsn: str) -> None:
    """A second execution of a completed key does not call the work and records a noop attempt."""
    calls: list[str] = []

    def work(ctx: RunContext) -> dict[str, int]:
        calls.append(ctx.run_key)
        return {"rows": 3}

    first = run_idempotently(
        connect=connect_to(pg_dsn), job_name="j", run_key="2026-10-01", work=work
    )
    second = run_idempotently(
        connect=connect_to(pg_dsn), job_name="j", run_key="2026-10-01", work=work
    )
    assert calls == ["2026-10-01"]
    assert (first.outcome, second.outcome) == (RunOutcome.COMPLETED, RunOutcome.NOOP)
    assert rows(pg_dsn, "SELECT outcome FROM idempotency.job_run_attempts ORDER BY attempt_id") == [
        ("completed",),
        ("noop",),
    ]
    assert rows(pg_dsn, "SELECT status, attempt_count, details FROM idempotency.job_runs") == [
        ("completed", 1, {"rows": 3})
    ]


def test_failure_then_rerun_completes(pg_dsn: str) -> None:
    """An exception marks the run failed and re-raises; the rerun completes the same key."""

    def boom(ctx: RunContext) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        run_idempotently(connect=connect_to(pg_dsn), job_name="j", run_key="k", work=boom)
    assert rows(pg_dsn, "SELECT status, details->>'last_error' FROM idempotency.job_runs") == [
        ("failed", "RuntimeError: disk full")
    ]
    run_idempotently(connect=connect_to(pg_dsn), job_name="j", run_key="k", work=lambda ctx: None)
    assert rows(pg_dsn, "SELECT status, attempt_count FROM idempotency.job_runs") == [
        ("completed", 2)
    ]
    assert rows(
        pg_dsn,
        "SELECT outcome, error IS NOT NULL FROM idempotency.job_run_attempts ORDER BY attempt_id",
    ) == [("failed", True), ("completed", False)]


def test_noop_passes_on_the_counts_of_the_completing_attempt(pg_dsn: str) -> None:
    """A no-op's counts are what the completing attempt's work returned: not what an earlier
    failed attempt left in job_runs.details (last_error), nor a forced rerun's leftovers."""

    def boom(ctx: RunContext) -> None:
        raise RuntimeError("disk full")

    run: dict[str, Any] = {"connect": connect_to(pg_dsn), "job_name": "j", "run_key": "k"}
    with pytest.raises(RuntimeError):
        run_idempotently(**run, work=boom)
    done = run_idempotently(**run, work=lambda ctx: {"orders": 2, "skipped": 1})
    assert done.counts == {"orders": 2, "skipped": 1}
    again = run_idempotently(**run, work=boom)
    assert (again.outcome, again.counts) == (RunOutcome.NOOP, {"orders": 2, "skipped": 1})
    forced = run_idempotently(**run, work=lambda ctx: {"orders": 3}, options=RunOptions(force=True))
    assert forced.counts == {"orders": 3}
    noop = run_idempotently(**run, work=boom)
    assert (noop.outcome, noop.counts) == (RunOutcome.NOOP, {"orders": 3})
    # job_runs.details merges them all: the no-op does not read it
    assert rows(pg_dsn, "SELECT details FROM idempotency.job_runs") == [
        ({"last_error": "RuntimeError: disk full", "orders": 3, "skipped": 1},)
    ]


def test_force_reruns_a_completed_key(pg_dsn: str) -> None:
    """force=True calls the work again for a completed key and completes it again."""
    calls: list[int] = []
    for _ in range(2):
        run_idempotently(
            connect=connect_to(pg_dsn), job_name="j", run_key="k", work=lambda ctx: calls.append(1)
        )
    result = run_idempotently(
        connect=connect_to(pg_dsn),
        job_name="j",
        run_key="k",
        work=lambda ctx: calls.append(1),
        options=RunOptions(force=True),
    )
    assert result.outcome is RunOutcome.COMPLETED and len(calls) == 2
    assert rows(pg_dsn, "SELECT status, attempt_count FROM idempotency.job_runs") == [
        ("completed", 2)
    ]


def test_dry_run_writes_nothing(pg_dsn: str) -> None:
    """A dry run's writes are rolled back, job_runs is untouched, and a dry_run attempt is recorded."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.facts (k text PRIMARY KEY)")

    def work(ctx: RunContext) -> dict[str, int]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('a')")
        with ctx.transaction() as cur:  # a later step sees the earlier one inside the dry run
            cur.execute("SELECT count(*) FROM public.facts")
            row = cur.fetchone()
            assert row is not None
            return {"seen": row[0]}

    result = run_idempotently(
        connect=connect_to(pg_dsn),
        job_name="j",
        run_key="k",
        work=work,
        options=RunOptions(dry_run=True),
    )
    assert result.outcome is RunOutcome.DRY_RUN and result.counts == {"seen": 1}
    assert rows(pg_dsn, "SELECT count(*) FROM public.facts") == [(0,)]
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.job_runs") == [(0,)]
    assert rows(pg_dsn, "SELECT outcome, dry_run FROM idempotency.job_run_attempts") == [
        ("dry_run", True)
    ]


def test_held_lock_is_reported_with_its_holder(pg_dsn: str) -> None:
    """While one execution works, a second one of the same key is refused and told who holds it."""
    inside = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def slow(ctx: RunContext) -> None:
        inside.set()
        release.wait(10)

    def first() -> None:
        try:
            run_idempotently(connect=connect_to(pg_dsn), job_name="j", run_key="k", work=slow)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(10)
    try:
        with pytest.raises(
            RunLockedError, match=r"locked by another execution: backend pid \d+"
        ) as info:
            run_idempotently(
                connect=connect_to(pg_dsn), job_name="j", run_key="k", work=lambda ctx: None
            )
        assert info.value.holder["attempt"]["hostname"]
        assert info.value.holder["application_name"].startswith("airflow-idempotency ")
        # A different key is not blocked.
        other = run_idempotently(
            connect=connect_to(pg_dsn), job_name="j", run_key="other", work=lambda ctx: None
        )
        assert other.outcome is RunOutcome.COMPLETED
    finally:
        release.set()
        thread.join()
    assert not errors
    assert rows(
        pg_dsn, "SELECT run_key, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id"
    ) == [("k", "completed"), ("k", "lock_held"), ("other", "completed")]


def test_lock_session_terminated_mid_run_does_not_complete(pg_dsn: str) -> None:
    """If the lock session is killed during the work, the attempt fails loudly and the run stays started."""

    def work(ctx: RunContext) -> dict[str, int]:
        terminate_lock_session(pg_dsn, "j", "k")
        return {"rows": 1}

    with pytest.raises(LockLostError):
        run_idempotently(connect=connect_to(pg_dsn), job_name="j", run_key="k", work=work)
    # Recorded from a fresh session as this attempt's failure; never as completed.
    assert rows(
        pg_dsn,
        "SELECT status, details->>'last_error' LIKE '%%lock connection was lost%%' FROM idempotency.job_runs",
    ) == [("failed", True)]
    assert rows(pg_dsn, "SELECT outcome FROM idempotency.job_run_attempts") == [("lock_lost",)]
    # A rerun converges.
    run_idempotently(connect=connect_to(pg_dsn), job_name="j", run_key="k", work=lambda ctx: None)
    assert rows(pg_dsn, "SELECT status FROM idempotency.job_runs") == [("completed",)]


def test_writes_after_losing_the_lock_are_refused(pg_dsn: str) -> None:
    """A transaction started after the lock session died is rolled back by the fencing check."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.facts (k text PRIMARY KEY)")

    def work(ctx: RunContext) -> None:
        terminate_lock_session(pg_dsn, "j", "k")
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('late write')")

    with pytest.raises(LockLostError, match="no longer held"):
        run_idempotently(connect=connect_to(pg_dsn), job_name="j", run_key="k", work=work)
    assert rows(pg_dsn, "SELECT count(*) FROM public.facts") == [(0,)]


def test_lock_is_released_after_the_run(pg_dsn: str) -> None:
    """No advisory lock is left behind after a completed, a failed and a no-op run."""
    run_idempotently(connect=connect_to(pg_dsn), job_name="j", run_key="k", work=lambda ctx: None)
    run_idempotently(connect=connect_to(pg_dsn), job_name="j", run_key="k", work=lambda ctx: None)
    with pytest.raises(ZeroDivisionError):
        run_idempotently(connect=connect_to(pg_dsn), job_name="j", run_key="k2", work=fail)
    assert advisory_locks(pg_dsn) == 0


def test_pooled_connection_is_handed_back_as_it_came(pg_dsn: str) -> None:
    """After every kind of run, the pool's connections keep their own search_path and name.

    A run holds two connections at once (the lock transaction and the work), so the pool
    has two, and both are checked.
    """
    from psycopg_pool import ConnectionPool

    def configure(conn: psycopg.Connection) -> None:
        conn.execute("SET search_path = app_schema, public")
        conn.execute("SET application_name = 'my-app'")
        conn.commit()

    def settings(pool: ConnectionPool) -> set[tuple[Any, ...]]:
        with pool.connection() as first, pool.connection() as second:
            return {
                tuple(
                    conn.execute(
                        "SELECT current_setting('search_path'), current_setting('application_name'),"
                        " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())"
                    ).fetchone()
                    or ()
                )
                for conn in (first, second)
            }

    expected = {("app_schema, public", "my-app", 0)}
    with ConnectionPool(pg_dsn, min_size=2, max_size=2, configure=configure) as pool:
        for key, work in (
            ("k", lambda ctx: None),
            ("k", lambda ctx: None),
            ("f", fail),
        ):
            with contextlib.suppress(ZeroDivisionError):
                run_idempotently(connect=pool.connection, job_name="j", run_key=key, work=work)
            assert settings(pool) == expected
        with psycopg.connect(pg_dsn, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", (run_lock_key("j", "held"),))
            with pytest.raises(RunLockedError):
                run_idempotently(
                    connect=pool.connection, job_name="j", run_key="held", work=lambda ctx: None
                )
        assert settings(pool) == expected
    assert rows(
        pg_dsn, "SELECT run_key, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id"
    ) == [("k", "completed"), ("k", "noop"), ("f", "failed"), ("held", "lock_held")]


def test_lock_key_mapping_is_stable() -> None:
    """The documented mapping (first 8 bytes of sha256(job \\x1f key), signed) does not change."""
    assert run_lock_key("finalize_invoices", "2026-10-01") == run_lock_key(
        "finalize_invoices", "2026-10-01"
    )
    assert run_lock_key("a", "bc") != run_lock_key("ab", "c")
    import hashlib

    digest = hashlib.sha256(b"finalize_invoices\x1f2026-10-01").digest()
    assert run_lock_key("finalize_invoices", "2026-10-01") == int.from_bytes(
        digest[:8], "big", signed=True
    )


def test_concurrent_schema_creation_is_safe(pg_dsn: str) -> None:
    """Eight workers creating the schema at once all succeed and version 1..n is recorded once."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def create() -> None:
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                barrier.wait()
                schema_mod._migrated.clear()
                schema_mod.ensure_schema(conn, "concurrent_schema")
        except BaseException as exc:  # pragma: no cover - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    versions = rows(pg_dsn, "SELECT version FROM concurrent_schema.schema_version ORDER BY version")
    assert [v for (v,) in versions] == list(range(1, schema_mod.latest_version() + 1))


def test_configurable_schema_name(pg_dsn: str) -> None:
    """The bookkeeping tables go to the configured schema."""
    run_idempotently(
        connect=connect_to(pg_dsn),
        job_name="j",
        run_key="k",
        work=lambda ctx: None,
        environment=RunEnvironment(schema="ops_jobs"),
    )
    assert rows(pg_dsn, "SELECT count(*) FROM ops_jobs.job_runs") == [(1,)]


def test_newer_schema_is_refused(pg_dsn: str) -> None:
    """A schema migrated by a newer release makes this release stop with a clear error."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        schema_mod.ensure_schema(conn, "future")
        conn.execute(
            "INSERT INTO future.schema_version (version, name) VALUES (999, 'from the future')"
        )
        schema_mod._migrated.clear()
        with pytest.raises(SchemaTooNewError, match="newer than this release"):
            schema_mod.ensure_schema(conn, "future")


def test_invalid_schema_name_is_refused(pg_dsn: str) -> None:
    """A schema name that is not a plain identifier is refused before anything is written."""
    from airflow_idempotency.exceptions import InvalidInputError

    with pytest.raises(InvalidInputError, match="invalid schema name"):
        run_idempotently(
            connect=connect_to(pg_dsn),
            job_name="j",
            run_key="k",
            work=lambda ctx: None,
            environment=RunEnvironment(schema='x"; drop'),
        )
    assert rows(pg_dsn, "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'x%%'") == [(0,)]


def test_upgrade_from_an_older_schema_version(pg_dsn: str) -> None:
    """A schema left at version 1 by an older release is migrated forward, keeping its rows."""
    from airflow_idempotency._sql import migrations

    version, name, body = migrations()[0]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA old_release")
        conn.execute(
            "CREATE TABLE old_release.schema_version (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        conn.execute("SET search_path = old_release")
        conn.execute(body.encode())
        conn.execute("INSERT INTO schema_version (version, name) VALUES (%s, %s)", (version, name))
        conn.execute(
            "INSERT INTO job_runs (job_name, run_key, lock_key, status, triggered_by, started_at)"
            " VALUES ('j', 'k', 1, 'completed', 'scheduled', now())"
        )
    schema_mod._migrated.clear()
    result = run_idempotently(
        connect=connect_to(pg_dsn),
        job_name="j",
        run_key="k",
        work=lambda ctx: None,
        environment=RunEnvironment(schema="old_release"),
    )
    assert result.outcome is RunOutcome.NOOP  # the old row survived the upgrade
    assert rows(pg_dsn, "SELECT max(version) FROM old_release.schema_version") == [
        (schema_mod.latest_version(),)
    ]
    assert rows(pg_dsn, "SELECT to_regclass('old_release.outbound_ledger') IS NOT NULL") == [
        (True,)
    ]


def test_schema_is_created_through_a_connection_without_autocommit(pg_dsn: str) -> None:
    """ensure_schema probes a missing schema without leaving the caller's session aborted."""
    schema_mod._migrated.clear()
    with psycopg.connect(pg_dsn) as conn:  # autocommit off, as psycopg connects by default
        assert schema_mod.current_version(conn, "manual_tx") == 0
        assert conn.info.transaction_status is psycopg.pq.TransactionStatus.IDLE
        assert schema_mod.ensure_schema(conn, "manual_tx") == schema_mod.latest_version()
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert rows(pg_dsn, "SELECT max(version) FROM manual_tx.schema_version") == [
        (schema_mod.latest_version(),)
    ]


def test_the_lock_transaction_holds_no_snapshot_and_no_table_lock(pg_dsn: str) -> None:
    """While the work runs, the lock session is idle in a transaction that holds the advisory
    lock and nothing else: no table lock (a migration never waits behind a running job), no
    transaction id and no snapshot (vacuum is not held back), its name in pg_stat_activity."""
    seen: dict[str, Any] = {}

    def work(ctx: RunContext) -> None:
        pid = run_lock_holder(pg_dsn, "j", "k")
        with psycopg.connect(pg_dsn) as observer:
            seen["activity"] = observer.execute(
                "SELECT state, backend_xid, backend_xmin, application_name FROM pg_stat_activity"
                " WHERE pid = %s",
                (pid,),
            ).fetchone()
            seen["locks"] = observer.execute(
                "SELECT locktype, mode FROM pg_locks WHERE pid = %s ORDER BY 1", (pid,)
            ).fetchall()

    run_idempotently(connect=connect_to(pg_dsn), job_name="j", run_key="k", work=work)
    state, xid, xmin, name = seen["activity"]
    assert (state, xid, xmin) == ("idle in transaction", None, None)
    assert name.startswith("airflow-idempotency ")
    assert seen["locks"] == [("advisory", "ExclusiveLock"), ("virtualxid", "ExclusiveLock")]


def test_an_idle_in_transaction_timeout_does_not_end_the_run(pg_dsn: str) -> None:
    """A database whose idle_in_transaction_session_timeout (1 s) is shorter than the work
    (2.5 s): the lock transaction lifts it for itself, and the run completes."""
    from psycopg import sql

    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET idle_in_transaction_session_timeout = '1s'").format(
                sql.Identifier(admin.info.dbname)
            )
        )

    def work(ctx: RunContext) -> None:
        import time

        time.sleep(2.5)

    result = run_idempotently(connect=connect_to(pg_dsn), job_name="j", run_key="k", work=work)
    assert result.outcome is RunOutcome.COMPLETED
    with psycopg.connect(pg_dsn) as conn:  # the setting itself is untouched
        assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("1s",)


def test_recorded_times_follow_the_run(pg_dsn: str) -> None:
    """Times written in the lock transaction are the statements' times, not the
    transaction's start: an attempt finishes after it started, the run completes after it."""
    import time

    run_idempotently(
        connect=connect_to(pg_dsn), job_name="j", run_key="k", work=lambda ctx: time.sleep(0.3)
    )
    ((started, finished),) = rows(
        pg_dsn, "SELECT started_at, finished_at FROM idempotency.job_run_attempts"
    )
    ((run_started, completed),) = rows(
        pg_dsn, "SELECT started_at, completed_at FROM idempotency.job_runs"
    )
    assert (finished - started).total_seconds() >= 0.3
    assert (completed - run_started).total_seconds() >= 0.3


class RecordingMetrics:
    """Airflow's Stats stand-in for the core (the real path: tests/integration/test_metrics.py)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.timers: list[str] = []

    def incr(self, stat: str, count: int = 1, *, tags: Any = None) -> None:
        assert tags and set(tags) <= {"job", "remote_system"}
        self.counts[stat] = self.counts.get(stat, 0) + count

    def timing(self, stat: str, dt: Any, *, tags: Any = None) -> None:
        self.timers.append(stat)


def test_every_outcome_is_counted(pg_dsn: str) -> None:
    """Completed, noop, failed, dry_run, lock_held, and a takeover of a killed worker's
    attempt each add one to their counter; decision and work are timed."""
    import subprocess
    import sys

    metrics = RecordingMetrics()

    def run(key: str, work: Any, **kw: Any) -> None:
        with contextlib.suppress(Exception):
            run_idempotently(
                connect=connect_to(pg_dsn),
                job_name="j",
                run_key=key,
                work=work,
                environment=RunEnvironment(metrics=metrics),
                **kw,
            )

    run("a", lambda ctx: None)
    run("a", lambda ctx: None)
    run("b", lambda ctx: 1 / 0)
    run("c", lambda ctx: None, options=RunOptions(dry_run=True))
    with psycopg.connect(pg_dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (run_lock_key("j", "d"),))
        run("d", lambda ctx: None)
    # A worker killed after its start was recorded, then the rerun takes the key over.
    code = (
        "import psycopg; from airflow_idempotency import run_idempotently;"
        f"run_idempotently(connect=lambda: psycopg.connect({pg_dsn!r}), job_name='j',"
        " run_key='e', work=lambda ctx: None)"
    )
    killed = subprocess.run(
        [sys.executable, "-c", code],
        env={**__import__("os").environ, "AIRFLOW_IDEMPOTENCY_CRASH_AT": "runner.after_started"},
        capture_output=True,
    )
    assert killed.returncode == -9, killed.stderr[-500:]
    run("e", lambda ctx: None)
    prefix = "idempotency.run."
    assert metrics.counts == {
        f"{prefix}completed": 2,
        f"{prefix}noop": 1,
        f"{prefix}failed": 1,
        f"{prefix}dry_run": 1,
        f"{prefix}lock_held": 1,
        f"{prefix}takeover": 1,
    }
    assert metrics.timers.count(f"{prefix}decision_ms") == 6
    assert metrics.timers.count(f"{prefix}work_ms") == 4
