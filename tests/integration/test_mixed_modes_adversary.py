"""A key decided in one lock mode while the other mode holds it (docs/locks.md: "switching
modes is safe (each refuses a key the other holds)"): a forced rerun of a completed key in
the lease mode, between its decision (the lease taken) and its start (the run taken over), is
a key held; a decision of the advisory mode then must refuse it, as a second decision of the
lease mode does, not report the completed run as a no-op while the rerun recomputes it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_idempotency.exceptions import RunLockedError
from airflow_idempotency.lease_run import LeaseRun
from airflow_idempotency.runner import RunContext, RunOptions, RunOutcome, run_idempotently
from airflow_idempotency.schema import ensure_schema
from devtools.postgres import PostgresServer, temporary_database

JOB, KEY = "mixed", "2026-12-04"


@pytest.fixture
def db(pg_server: PostgresServer) -> Iterator[str]:
    with temporary_database(pg_server, "adv32d_mixed") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ensure_schema(conn)
        yield dsn


def _run(dsn: str, mode: str, force: bool = False) -> Any:
    def work(ctx: RunContext) -> dict[str, Any]:
        return {"mode": mode, "force": force}

    return run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=JOB,
        run_key=KEY,
        work=work,
        lock_mode=mode,
        options=RunOptions(force=force),
    )


@pytest.mark.parametrize("second", ["lease", "advisory"])
def test_a_forced_lease_rerun_holds_its_key_before_its_start_in_both_modes(
    db: str, second: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _run(db, "lease").outcome is RunOutcome.COMPLETED
    leased, go_on = threading.Event(), threading.Event()
    original = LeaseRun._run_lease

    def paused(self: LeaseRun, lease: Any, existing: Any) -> Any:
        leased.set()  # the lease is taken; the start has not run
        assert go_on.wait(30)
        return original(self, lease, existing)

    monkeypatch.setattr(LeaseRun, "_run_lease", paused)
    outcome: list[Any] = []
    rerun = threading.Thread(target=lambda: outcome.append(_run(db, "lease", force=True)))
    rerun.start()
    try:
        assert leased.wait(30)
        with pytest.raises(RunLockedError, match="lease token"):  # the holder named
            _run(db, second)
    finally:
        go_on.set()
        rerun.join(30)
    assert outcome and outcome[0].outcome is RunOutcome.COMPLETED
