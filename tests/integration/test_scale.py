"""Issue 32's scale scenario at CI size: 40 runs at once through PgBouncer in transaction mode
with a pool of 10, in each lock mode. The scenario is the scale benchmark's own
(bench/scale.py, ``run_cell``): threads calling ``run_idempotently`` whose work sleeps, writes
one row through ``run.transaction()`` and, every third run, sends effects through the ledger
to the accounting service; peak server connections sampled from pg_stat_activity."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psycopg
import pytest

from bench.scale import Cell, Scenario, lock_mode_available, run_cell
from devtools import pgbouncer
from devtools.accounting import AccountingService, run_accounting_service
from devtools.postgres import PostgresServer, temporary_database

RUNS = 40
POOL = 10


@pytest.fixture(scope="module", autouse=True)
def _pgbouncer_installed() -> None:
    if not pgbouncer.installed():
        if os.environ.get("CI"):
            pytest.fail("pgbouncer is not installed (.ci/run installs it)")
        pytest.skip("pgbouncer is not installed: apt-get install pgbouncer")


@pytest.fixture(scope="module")
def remote(pg_server: PostgresServer) -> Iterator[AccountingService]:
    """The accounting service (a deduplicating remote) on a database of its own."""
    with (
        temporary_database(pg_server, "scale_remote") as dsn,
        run_accounting_service(dsn) as service,
    ):
        yield service


def through_pool(pg_server: PostgresServer, remote: AccountingService, mode: str) -> Cell:
    """40 runs at once through a pool of 10; a stalled pool ends within 5 s
    (query_wait_timeout), the whole cell within 40 s."""
    scenario = Scenario(
        RUNS,
        mode,
        "pgbouncer",
        pool_size=POOL,
        work_seconds=1.0,
        effects_per_export=3,
        query_wait_timeout=5,
        bound_seconds=40,
    )
    return run_cell(pg_server, remote, scenario)


@pytest.mark.xfail(
    strict=True,
    reason="issue 32: the advisory lock's transaction pins a server connection for the whole "
    "run, so behind a transaction pooler N runs need default_pool_size >= N + 1; at N >= "
    "pool size it is a cliff (every run waits until query_wait_timeout, then fails)",
)
def test_advisory_mode_through_a_pool_of_10(
    pg_server: PostgresServer, remote: AccountingService
) -> None:
    """Advisory mode: 40 runs through a pool of 10 all complete, each key's work once (the cliff
    of issue 32 today)."""
    cell = through_pool(pg_server, remote, "advisory")
    assert not cell.timed_out, cell.summary()
    assert cell.keys_repeated == 0, cell.summary()
    assert cell.all_completed_once, cell.summary()


def test_lease_mode_through_a_pool_of_10(
    pg_server: PostgresServer, remote: AccountingService
) -> None:
    """Lease mode: 40 runs through a pool of 10 all complete, each key's work committed once,
    every effect at the remote once, and never more than 10 server connections."""
    missing = lock_mode_available("lease")
    if missing:
        pytest.skip(f"lease mode is not available yet: {missing}")
    cell = through_pool(pg_server, remote, "lease")
    assert cell.all_completed_once, cell.summary()
    assert cell.remote_replays == 0, cell.summary()
    assert cell.peak_server_connections <= POOL, cell.summary() + "\n" + "\n".join(cell.at_peak)


def test_lease_mode_runs_spread_over_processes(
    pg_server: PostgresServer, remote: AccountingService
) -> None:
    """The benchmark's multi-process driver (bench/scale_drivers.py): 24 lease-mode runs as
    threads of 3 processes, released together, through a pool of 4; the cell tallies every
    process's runs as the in-process driver does (each run once, each key's work once, every
    effect once, an overhead per completed run, never more than 4 server connections)."""
    missing = lock_mode_available("lease")
    if missing:
        pytest.skip(f"lease mode is not available yet: {missing}")
    scenario = Scenario(
        24,
        "lease",
        "pgbouncer",
        pool_size=4,
        work_seconds=0.5,
        effects_per_export=2,
        query_wait_timeout=10,
        bound_seconds=60,
        processes=3,
    )
    cell = run_cell(pg_server, remote, scenario)
    assert cell.all_completed_once, cell.summary()
    assert cell.completed == 24 and len(cell.overhead_ms) == 24, cell.summary()
    assert cell.effects_expected == 8 * 2 and cell.remote_replays == 0, cell.summary()
    assert 0 < cell.start_spread_ms < cell.wall_seconds * 1000, cell.summary()
    assert cell.peak_server_connections <= 4, cell.summary() + "\n" + "\n".join(cell.at_peak)


def test_pgbouncer_keeps_answering_after_many_logins(pg_server: PostgresServer) -> None:
    """The harness's PgBouncer logs every login to stderr as well as to its logfile: 600
    connections, one after the other, each answer within their connect_timeout. (With its
    stderr on a pipe nobody read, the pipe filled after a few hundred logins and PgBouncer's
    one thread blocked writing to it: every connection stalled, which looked like the lease
    mode's runs stalling at N=100.)"""
    with (
        temporary_database(pg_server, "scale_logins") as dsn,
        pgbouncer.run_pgbouncer(pg_server, "transaction", pool_size=2) as bouncer,
    ):
        target = bouncer.dsn(str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]))
        began = time.monotonic()
        for _ in range(600):
            with psycopg.connect(target, autocommit=True, connect_timeout=5) as conn:
                conn.execute("SELECT 1")
        assert time.monotonic() - began < 40


def test_lease_mode_overload_60_runs_through_a_pool_of_5(
    pg_server: PostgresServer, remote: AccountingService
) -> None:
    """Issue 32's overload at CI size: 60 lease-mode runs at once through a pool of 5 (twelve
    times what the pool serves at once) all complete, each key's work once, every effect
    once, never more than 5 server connections."""
    missing = lock_mode_available("lease")
    if missing:
        pytest.skip(f"lease mode is not available yet: {missing}")
    scenario = Scenario(
        60,
        "lease",
        "pgbouncer",
        pool_size=5,
        work_seconds=1.0,
        effects_per_export=3,
        query_wait_timeout=10,
        bound_seconds=45,
    )
    cell = run_cell(pg_server, remote, scenario)
    assert cell.all_completed_once, cell.summary()
    assert cell.remote_replays == 0, cell.summary()
    assert cell.peak_server_connections <= 5, cell.summary()
