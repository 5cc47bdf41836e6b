"""What operators read about run keys held in the lease mode (docs/locks.md), on a real
PostgreSQL: a live lease holds its key as an advisory lock does, in every place that asks "is
this key held, by whom, is this running attempt alive" (`locks`, `runs --stale`, `plan`,
`adopt --apply`, the Run keys view); an expired one is free to take over, and its running
attempt is stale like one whose lock session ended.

The worker is a real lease-mode run killed after its start (its lease then stays live until
it expires: the default time to live, 30 s) and its lease expired as if nobody renewed it."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_idempotency import adoption, planning
from airflow_idempotency.leases import acquire_lease
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.schema import ensure_schema
from airflow_idempotency.ui.reads import RecordsReader, RunFilters, Visibility
from devtools.postgres import PostgresServer, temporary_database
from support.cli import abandon, cli
from support.db import rows
from support.locks import expire_lease, key_held

JOB, KEY, OTHER = "leased_job", "2026-10-01", "2026-10-02"
EXPIRED = "expired, free to take over"


@pytest.fixture
def leased(pg_server: PostgresServer) -> Iterator[str]:
    """A database whose (JOB, KEY) was started by a lease-mode worker that was then killed:
    the key started, its attempt running, its lease live; returns the DSN."""
    with temporary_database(pg_server, "leasevis_test") as dsn:
        abandon(dsn, JOB, KEY, lock_mode="lease")
        assert rows(dsn, "SELECT count(*) FROM idempotency.run_leases") == [(1,)]
        yield dsn


def test_locks_shows_a_live_lease_its_holder_and_an_expired_one_as_free(
    leased: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`locks` lists the lease (mode, token, worker, expiry) beside an advisory lock held at
    the same time; once expired the lease is listed as free to take over."""
    ((token, holder),) = rows(leased, "SELECT token, holder FROM idempotency.run_leases")
    with key_held(leased, JOB, OTHER):
        code, found, _ = cli(capsys, "locks", "--dsn", leased)
    assert code == 0
    by_key = {row["run_key"]: row for row in found}
    assert set(by_key) == {KEY, OTHER}
    lease = by_key[KEY]
    assert (lease["lock_mode"], lease["state"], lease["status"]) == ("lease", "held", "started")
    assert (lease["lease_token"], lease["lease_holder"]) == (token, holder)
    assert lease["lease_expires_at"] is not None and lease["backend_pid"] is None
    assert lease["worker_host"] and lease["worker_pid"] and lease["attempt_started_at"]
    assert (by_key[OTHER]["lock_mode"], by_key[OTHER]["state"]) == ("advisory", "held")
    assert by_key[OTHER]["backend_pid"] is not None

    expire_lease(leased, JOB, KEY)
    code, found, _ = cli(capsys, "locks", "--dsn", leased)
    assert code == 0
    assert [(r["run_key"], r["lock_mode"], r["state"]) for r in found] == [(KEY, "lease", EXPIRED)]
    assert "expired" in cli_table(capsys, "locks", "--dsn", leased)  # the table wraps cells


def cli_table(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The command's table output (not --json)."""
    from airflow_idempotency.cli import main

    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_runs_stale_counts_a_live_lease_as_held_and_an_expired_one_as_stale(
    leased: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The killed worker's attempt is not stale while its lease is live (its key comes free
    when the lease expires); once expired it is listed, saying so, exit 1."""
    code, found, _ = cli(capsys, "runs", "--stale", "--dsn", leased)
    assert (code, found) == (0, [])
    expire_lease(leased, JOB, KEY)
    code, found, _ = cli(capsys, "runs", "--stale", "--dsn", leased)
    assert code == 1
    (row,) = found
    assert (row["run_key"], row["status"]) == (KEY, "started")
    assert row["attempt_id"] is not None
    assert "lease expired" in row["lock"] and "free to take over" in row["lock"]


def test_plan_says_locked_while_a_lease_is_live(leased: str) -> None:
    """What `plan` reads for each key: locked while its lease is live, not once expired."""
    with psycopg.connect(leased, autocommit=True) as conn:
        assert planning._states(conn, "idempotency", [(JOB, KEY)]) == {
            (JOB, KEY): ("started", True)
        }
        expire_lease(leased, JOB, KEY)
        assert planning._states(conn, "idempotency", [(JOB, KEY)]) == {
            (JOB, KEY): ("started", False)
        }


def _adoption(run_key: str) -> adoption.Adoption:
    run = adoption.SucceededRun("scheduled__x", "scheduled", None, dt.datetime.now(dt.UTC))
    return adoption.Adoption(run, "load", JOB, run_key, "adopt")


def test_adopt_apply_leaves_a_key_with_a_live_lease_alone(pg_dsn: str) -> None:
    """A lease taken and its run not started yet (no record): `adopt --apply` must not
    record the key the leased run is about to work on; once the lease expired it may."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        ensure_schema(conn, "idempotency")
        assert acquire_lease(conn, run_lock_key(JOB, KEY), schema="idempotency", ttl=30)
        planned = [_adoption(KEY)]
        adoption.apply(conn, "idempotency", "dag", planned)
        assert (planned[0].would, planned[0].reason) == (
            "locked",
            "another execution holds the key now",
        )
        assert rows(pg_dsn, "SELECT count(*) FROM idempotency.job_runs") == [(0,)]
        expire_lease(pg_dsn, JOB, KEY)
        planned = [_adoption(KEY)]
        adoption.apply(conn, "idempotency", "dag", planned)
        assert planned[0].would == "adopted"


def test_the_view_shows_a_leased_run_as_running_with_its_lease(leased: str) -> None:
    """The Run keys view: the leased key is running now (not interrupted), listed among the
    locks with its lease, and its page names the lease; once expired it is interrupted, no
    longer among the locks, and its page says the lease expired."""
    with psycopg.connect(leased, autocommit=True) as conn:
        reader = RecordsReader(conn, "idempotency", Visibility(all_dags=True))
        overview = reader.overview(RunFilters())
        assert overview.counts == {"failed": 0, "running": 1, "interrupted": 0}
        assert [r["state"] for r in overview.runs] == ["running"]
        assert [r["state"] for r in overview.attention] == ["running"]
        (lock,) = reader.locks()
        assert (lock["job_name"], lock["run_key"], lock["lock_mode"]) == (JOB, KEY, "lease")
        assert lock["lease_token"] is not None and lock["held_since"] is not None
        key = reader.key(JOB, KEY)
        assert key is not None and key.run is not None and key.run["state"] == "running"
        assert key.lease is not None and key.lease["live"] and key.lease["attempt_id"]
        calendar = reader.calendar(JOB)
        assert calendar is not None and calendar.counts["running"] == 1

        expire_lease(leased, JOB, KEY)
        overview = reader.overview(RunFilters())
        assert overview.counts == {"failed": 0, "running": 0, "interrupted": 1}
        assert overview.locks == [] and reader.locks() == []
        key = reader.key(JOB, KEY)
        assert key is not None and key.run is not None and key.run["state"] == "interrupted"
        assert key.lease is not None and not key.lease["live"]


def test_adopt_apply_sees_a_lease_taken_just_before_its_lock_whatever_the_isolation(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the database's default isolation REPEATABLE READ, a lease committed after the
    key's transaction began but before it took the lock is still seen (the transaction runs
    READ COMMITTED: the check after the lock reads a snapshot taken after it)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        ensure_schema(conn, "idempotency")
        conn.execute(
            sql.SQL(
                "ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'"
            ).format(sql.Identifier(conn.info.dbname))
        )
    real_query = adoption.query  # type: ignore[attr-defined]

    def lease_taken_first(name: str, schema: str) -> Any:
        if name == "adopt_lock":  # the key's transaction began: a worker takes the lease now
            with psycopg.connect(pg_dsn, autocommit=True) as worker:
                lease = acquire_lease(worker, run_lock_key(JOB, KEY), schema=schema, ttl=30)
                assert lease is not None
        return real_query(name, schema)

    monkeypatch.setattr(adoption, "query", lease_taken_first)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SHOW default_transaction_isolation").fetchone() == ("repeatable read",)
        planned = [_adoption(KEY)]
        adoption.apply(conn, "idempotency", "dag", planned)
    assert planned[0].would == "locked"
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.job_runs") == [(0,)]
