"""Upgrades under load: the next release's migration beside a nightly pg_dump and a fleet of
workers of the current release, and a migrating worker that stops mid-migration.

The next release is this code with one more migration (an ALTER TABLE of job_runs and of
outbound_ledger, support.upgrades); the migration runs with the default bounds (each lock wait
2 s, a silent client's transaction 10 s) except where a scenario shortens the overall wait.

The advisory mode only: the scenarios are about the migration's own locks (its advisory
migration lock, the ALTER TABLEs' lock waits) beside a fleet, which the fleet's lock mode
does not change.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_idempotency import crashpoints
from airflow_idempotency import schema as schema_mod
from airflow_idempotency.exceptions import MigrationBlockedError
from airflow_idempotency.runner import RunOutcome, run_idempotently
from support.db import rows
from support.faults import figures
from support.locks import Background
from support.upgrades import Releases


def fleet_run(dsn: str, run_key: str) -> float:
    """One run of the current release (a worker of the fleet); its wall time in seconds."""
    started = time.monotonic()
    result = run_idempotently(
        connect=lambda: psycopg.connect(dsn), job_name="fleet", run_key=run_key, work=lambda c: None
    )
    assert result.outcome is RunOutcome.COMPLETED
    return time.monotonic() - started


def server_major(dsn: str) -> int:
    return int(rows(dsn, "SHOW server_version_num")[0][0]) // 10000


def pg_dump_major() -> int | None:
    try:
        said = subprocess.run(
            ["pg_dump", "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"(\d+)\.\d+", said)
    return int(found.group(1)) if found else None


def test_a_nightly_pg_dump_stalls_neither_the_upgrade_nor_the_fleet(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pg_dump that stalls on its output (it holds ACCESS SHARE on every table until it ends)
    while the next release migrates: the migration gives up within its bound naming pg_dump,
    the current release's runs meanwhile finish within about one lock timeout, and once the
    dump has finished the migration goes through."""
    major = pg_dump_major()
    if major is None or major < server_major(pg_dsn):
        pytest.skip(f"no pg_dump for this server (pg_dump {major}, server {server_major(pg_dsn)})")
    releases = Releases(monkeypatch)
    releases.old()
    fleet_run(pg_dsn, "2026-10-01")
    # 30 MB to dump: more than the pipe and the socket buffers hold, so pg_dump stalls mid-dump
    rows(
        pg_dsn,
        "CREATE TABLE public.history AS SELECT g, repeat('x', 300) AS pad "
        "FROM generate_series(1, 100000) AS g",
    )
    dump = subprocess.Popen(["pg_dump", "--dbname", pg_dsn], stdout=subprocess.PIPE)
    try:
        time.sleep(1.0)  # it has locked every table and fills the pipe nobody reads yet
        releases.new()
        bounds = dataclasses.replace(schema_mod.MIGRATION_BOUNDS, give_up_after=15.0)
        started = time.monotonic()
        migration = Background(lambda: migrate(pg_dsn, bounds))
        time.sleep(0.5)
        releases.old()  # the fleet: workers of the current release, runs starting now
        fleet = [fleet_run(pg_dsn, f"2026-10-{day:02d}") for day in range(2, 7)]
        migration.thread.join(timeout=60)
        assert not migration.thread.is_alive()
        assert migration.finished_at is not None
        gave_up = migration.finished_at - started
    finally:
        dump.stdout.read() if dump.stdout else None  # let the dump finish
        dump.wait(timeout=120)
    error = migration.error
    assert isinstance(error, MigrationBlockedError), migration.result
    assert "'pg_dump'" in str(error) and "pid " in str(error)
    assert gave_up < bounds.give_up_after + bounds.lock_timeout + 5, gave_up
    assert max(fleet) < 2 * bounds.lock_timeout + 3, fleet
    releases.new()
    again = time.monotonic()
    assert migrate(pg_dsn, bounds) == releases.probe.version
    figures(
        f"migration gave up after {gave_up:.1f} s (bound {bounds.give_up_after:g} s, lock "
        f"waits {bounds.lock_timeout:g} s) naming {error.blockers[0]['application_name']!r}; "
        f"5 fleet runs meanwhile took {min(fleet):.2f}-{max(fleet):.2f} s; after the dump "
        f"ended the migration took {time.monotonic() - again:.2f} s"
    )


def migrate(dsn: str, bounds: Any) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return schema_mod.ensure_schema(conn, "idempotency", bounds=bounds)


def test_a_worker_stopped_mid_migration_loses_its_locks_within_the_bound(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A worker that stops talking mid-migration (after its ALTER TABLE took ACCESS EXCLUSIVE
    on job_runs, before COMMIT: a frozen or cut-off host) loses its session within the default
    10 s dead-peer bound; the fleet's runs waiting on job_runs then go on, and the migration is
    rolled back whole (on b2bdd8d the lock stayed as long as the client did)."""
    releases = Releases(monkeypatch)
    releases.old()
    fleet_run(pg_dsn, "2026-10-01")
    releases.new()
    gate = tmp_path / "never"
    monkeypatch.setenv(crashpoints.WAIT_ENV, f"schema.after_migration={gate}")
    monkeypatch.setattr(crashpoints, "_slept", {})
    started = time.monotonic()
    migration = Background(lambda: migrate(pg_dsn, schema_mod.MIGRATION_BOUNDS))
    try:
        time.sleep(1.0)  # the migration reached its fault point holding ACCESS EXCLUSIVE
        releases.old()
        took = fleet_run(pg_dsn, "2026-10-02")  # waits on job_runs until the session ends
        freed = time.monotonic() - started
    finally:
        gate.touch()
        migration.thread.join(timeout=30)
    bound = schema_mod.MIGRATION_BOUNDS.idle_in_transaction
    assert freed < bound + 6, freed
    error = migration.error  # the server ended the session: IdleInTransactionSessionTimeout
    assert isinstance(error, psycopg.Error) and "idle-in-transaction" in str(error), (
        migration.result
    )
    assert rows(
        pg_dsn,
        "SELECT count(*) FROM idempotency.schema_version WHERE name = %s",
        (releases.probe.name,),
    ) == [(0,)]
    figures(
        f"job_runs freed {freed:.1f} s after the migration began (bound {bound:g} s idle in "
        f"transaction); a fleet run waited {took:.1f} s then completed; the stopped worker "
        f"got {type(migration.error).__name__}, nothing of the migration applied"
    )
