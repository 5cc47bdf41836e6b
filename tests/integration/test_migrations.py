"""Migrations on a real PostgreSQL: every wait bounded, every file identified (issue 30).

A migration that waits for a long reader gives up within its bound and names the reader; the
statements of other workers never queue behind it for longer than its lock timeout; the record
of applied files holds names and checksums, adopts a number-only record without running
anything again, and refuses an edited file and a database newer than the code. (A nightly
pg_dump and a client stopped mid-migration, with the default bounds: tests/faults/
test_faults_upgrade.py.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from airflow_idempotency import schema as schema_mod
from airflow_idempotency._sql import migrations
from airflow_idempotency.migrator import MigrationBounds
from support.db import rows
from support.locks import Background
from support.upgrades import Releases

FAST = MigrationBounds(lock_timeout=0.3, give_up_after=2.0, idle_in_transaction=1.0)


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    schema_mod._migrated.clear()
    yield
    schema_mod._migrated.clear()


def migrated(dsn: str, schema: str = "idempotency") -> None:
    """The schema at this release's version."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema_mod.ensure_schema(conn, schema)
    schema_mod._migrated.clear()


@pytest.fixture
def releases(monkeypatch: pytest.MonkeyPatch) -> Releases:
    """This release and the next one; the process runs this one until switched."""
    return Releases(monkeypatch)


def upgrade_pending(dsn: str, releases: Releases) -> str:
    """The schema at this release's version and the process on the next one, whose migration
    (an ALTER TABLE of outbound_ledger) is pending: that migration's file name."""
    migrated(dsn)
    releases.new()
    return releases.probe.name


def probe_applied(dsn: str, name: str) -> int:
    """How many times the record lists the file ``name`` (0 or 1)."""
    found = rows(dsn, "SELECT count(*) FROM idempotency.schema_version WHERE name = %s", (name,))
    return int(found[0][0])


@contextmanager
def reader(dsn: str, table: str, name: str = "nightly-report") -> Iterator[int]:
    """A long reader (a report, pg_dump): a transaction that read ``table`` and stays open,
    holding ACCESS SHARE on it; its backend pid."""
    conn = psycopg.connect(dsn, application_name=name)
    try:
        conn.execute(f"SELECT count(*) FROM idempotency.{table}")
        yield conn.info.backend_pid
    finally:
        conn.close()


def ensure(dsn: str, bounds: MigrationBounds = FAST, schema: str = "idempotency") -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return schema_mod.ensure_schema(conn, schema, bounds=bounds)


def test_a_long_reader_makes_a_migration_give_up_and_name_it(
    pg_dsn: str, releases: Releases
) -> None:
    """A migration whose ALTER TABLE waits for a long reader (ACCESS SHARE held in an open
    transaction) gives up within its bound with MigrationBlockedError naming the reader (pid,
    application_name, state) and what to do; nothing of it is applied, and it goes through once
    the reader has gone (on b2bdd8d it waited as long as the reader)."""
    from airflow_idempotency.exceptions import MigrationBlockedError

    name = upgrade_pending(pg_dsn, releases)
    with reader(pg_dsn, "outbound_ledger") as pid:
        started = time.monotonic()
        migration = Background(lambda: ensure(pg_dsn))
        migration.thread.join(timeout=20)
        waited = time.monotonic() - started
        assert not migration.thread.is_alive(), f"the migration still waits after {waited:.0f} s"
    error = migration.error
    assert isinstance(error, MigrationBlockedError), migration.result
    assert waited < FAST.give_up_after + 5
    message = str(error)
    assert f"pid {pid}" in message and "'nightly-report'" in message
    assert "idle in transaction" in message and "pg_terminate_backend" in message
    assert "airflow-idempotency migrate" in message and "Nothing was changed" in message
    assert [b["pid"] for b in error.blockers] == [pid]
    assert rows(
        pg_dsn, "SELECT count(*) FROM idempotency.schema_version WHERE name = %s", (name,)
    ) == [(0,)]
    assert ensure(pg_dsn) == schema_mod.latest_version()  # the reader is gone: it goes through
    assert rows(
        pg_dsn, "SELECT count(*) FROM idempotency.schema_version WHERE name = %s", (name,)
    ) == [(1,)]


def test_other_workers_statements_do_not_queue_behind_a_blocked_migration(
    pg_dsn: str, releases: Releases
) -> None:
    """While a migration waits for a long reader, a worker's ledger statement on the same table
    waits at most about one lock timeout, not for the reader (on b2bdd8d it queued behind the
    pending ALTER until the reader ended: here it would have hit its own 10 s lock_timeout)."""
    upgrade_pending(pg_dsn, releases)
    slow = MigrationBounds(lock_timeout=0.3, give_up_after=8.0, idle_in_transaction=1.0)
    with reader(pg_dsn, "outbound_ledger"):
        migration = Background(lambda: ensure(pg_dsn, slow))
        time.sleep(0.5)  # the migration is queued or between tries
        waits = []
        with psycopg.connect(pg_dsn, autocommit=True) as worker:
            worker.execute("SET lock_timeout = '10s'")
            for _ in range(5):
                started = time.monotonic()
                worker.execute("UPDATE idempotency.outbound_ledger SET call_count = 0 WHERE false")
                waits.append(time.monotonic() - started)
                time.sleep(0.2)
        assert migration.thread.is_alive(), (
            migration.result
        )  # still retrying: the reader still holds its lock
    migration.thread.join(timeout=20)
    assert max(waits) < 3.0, waits
    assert migration.finished_at is not None


def test_waiting_behind_a_migrating_worker_is_bounded_and_names_it(
    pg_dsn: str, releases: Releases
) -> None:
    """A worker that finds another migrating (the migration lock held) gives up within its
    bound with MigrationBlockedError naming that worker, instead of queueing without end."""
    from airflow_idempotency.exceptions import MigrationBlockedError
    from airflow_idempotency.locks import migration_lock_key

    upgrade_pending(pg_dsn, releases)
    with psycopg.connect(pg_dsn, application_name="worker-a-migrating") as other:
        other.execute("SELECT pg_advisory_xact_lock(%s)", (migration_lock_key("idempotency"),))
        with pytest.raises(MigrationBlockedError) as raised:
            ensure(pg_dsn)
        assert f"pid {other.info.backend_pid}" in str(raised.value)
        assert "'worker-a-migrating'" in str(raised.value)


def number_only_record(dsn: str) -> None:
    """The schema as a release that recorded numbers and names only left it."""
    migrated(dsn)
    rows(dsn, "ALTER TABLE idempotency.schema_version DROP COLUMN checksum")


def test_a_number_only_record_is_adopted_without_running_anything_again(pg_dsn: str) -> None:
    """A database migrated by a release that recorded numbers only gets each file's checksum,
    and no migration runs again (an index dropped since stays dropped)."""
    number_only_record(pg_dsn)
    rows(pg_dsn, "DROP INDEX idempotency.job_runs_run_key_idx")  # migration 5 would recreate it
    before = rows(
        pg_dsn, "SELECT version, name, applied_at FROM idempotency.schema_version ORDER BY 1"
    )
    assert ensure(pg_dsn) == schema_mod.latest_version()
    after = rows(
        pg_dsn,
        "SELECT version, name, applied_at, checksum FROM idempotency.schema_version ORDER BY 1",
    )
    assert [row[:3] for row in after] == before
    assert [row[3] for row in after] == [m.checksum for m in migrations()]
    assert rows(pg_dsn, "SELECT to_regclass('idempotency.job_runs_run_key_idx')") == [(None,)]


def test_a_fresh_schema_records_name_and_checksum_of_each_file(pg_dsn: str) -> None:
    """Each applied file is recorded by number, file name and SHA-256 of its text."""
    ensure(pg_dsn)
    recorded = rows(
        pg_dsn, "SELECT version, name, checksum FROM idempotency.schema_version ORDER BY 1"
    )
    assert recorded == [(m.version, m.name, m.checksum) for m in migrations()]
    assert all(len(checksum) == 64 for _, _, checksum in recorded)


@pytest.mark.parametrize(
    ("column", "value", "said"),
    [
        ("checksum", "0" * 64, "the file was edited after the database applied it"),
        ("name", "0002_something_else.sql", "as 0002_something_else.sql, this release ships"),
    ],
)
def test_an_applied_migration_that_differs_is_refused(
    pg_dsn: str, releases: Releases, column: str, value: str, said: str
) -> None:
    """An applied file whose checksum or name differs from this release's file of that number
    is refused with MigrationMismatchError (not retryable), before anything runs."""
    from airflow_idempotency.exceptions import ConfigurationError, MigrationMismatchError

    name = upgrade_pending(pg_dsn, releases)  # a migration pending: nothing of it runs
    rows(pg_dsn, f"UPDATE idempotency.schema_version SET {column} = %s WHERE version = 2", (value,))
    with pytest.raises(MigrationMismatchError, match=said) as raised:
        ensure(pg_dsn)
    assert isinstance(raised.value, ConfigurationError)
    assert "A migration never changes once applied" in str(raised.value)
    assert probe_applied(pg_dsn, name) == 0


def test_a_database_newer_than_the_code_is_refused_retryably(pg_dsn: str) -> None:
    """A schema migrated by a newer release: SchemaTooNewError names both versions and the
    fix, is not a ConfigurationError (a retry on an upgraded worker succeeds), writes nothing."""
    from airflow_idempotency.exceptions import ConfigurationError, SchemaTooNewError

    migrated(pg_dsn)
    newer = schema_mod.latest_version() + 1
    rows(
        pg_dsn,
        "INSERT INTO idempotency.schema_version (version, name, checksum) VALUES (%s, %s, %s)",
        (newer, f"{newer:04d}_from_the_future.sql", "f" * 64),
    )
    with pytest.raises(SchemaTooNewError) as raised:
        ensure(pg_dsn)
    error = raised.value
    assert not isinstance(error, ConfigurationError)
    assert (error.version, error.expected) == (newer, schema_mod.latest_version())
    assert f"at version {newer} ({newer:04d}_from_the_future.sql)" in str(error)
    assert "Upgrade the provider on this worker" in str(error)


def test_migrate_exits_75_naming_the_blocker_when_it_waited_too_long(
    pg_dsn: str, releases: Releases, capsys: pytest.CaptureFixture[str]
) -> None:
    """`airflow-idempotency migrate --wait 1` behind a long reader exits 75 (try again later)
    with the message naming the reader; once it has gone, the same command migrates."""
    from airflow_idempotency.cli import main

    name = upgrade_pending(pg_dsn, releases)
    with reader(pg_dsn, "job_runs", name="quarterly-report") as pid:
        assert main(["migrate", "--dsn", pg_dsn, "--wait", "1"]) == 75
    said = capsys.readouterr().err
    assert f"pid {pid}" in said and "'quarterly-report'" in said and "gave up after 1 s" in said
    assert probe_applied(pg_dsn, name) == 0
    schema_mod._migrated.clear()
    assert main(["migrate", "--dsn", pg_dsn]) == 0
    assert f"-> {releases.probe.version}" in capsys.readouterr().out
    assert probe_applied(pg_dsn, name) == 1
