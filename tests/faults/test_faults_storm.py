"""Storm: 32 OS processes call run_idempotently at the same instant.

Plain processes (multiprocessing, spawn), not Airflow: 32 Airflow workers would not fit
on this machine. Each process imports everything, connects nothing yet, and waits at a
barrier; the barrier releases all 32 at once into ``run_idempotently``.

The storm runs on a private embedded PostgreSQL: 32 to 64 sessions at once would eat the
shared server's connection budget (max_connections 100, much of it used by other work),
and its pg_locks then shows only our locks.

The one-key storm runs in the lease mode too (``[lease]``: 32 decisions racing for one lease
row instead of one advisory lock). The 32-key storm counts the advisory locks held at once,
which the lease mode does not take: tests/faults/test_faults_pgbouncer.py shows its
counterpart (more runs than server connections, all holding their keys at once).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_idempotency.exceptions import RunLockedError
from airflow_idempotency.runner import RunContext, run_idempotently
from airflow_idempotency.schema import ensure_schema
from support.db import rows
from support.faults import figures, lock_modes_used
from support.locks import advisory_locks

pytestmark = pytest.mark.slow

PROCESSES = 32
JOB = "storm"
BARRIER_TIMEOUT = 300.0  # spawning 32 interpreters on 2 busy cores takes a while
JOIN_TIMEOUT = 360.0


def contender(
    dsn: str,
    run_key: str,
    start: Any,
    inside: Any,
    counted: Any,
    results: Any,
    lock_mode: str = "advisory",
) -> None:
    """One storm process: wait for the start, run the key (``lock_mode``), report outcome
    and timing."""
    observed: dict[str, int] = {}

    def work(ctx: RunContext) -> dict[str, int]:
        with ctx.transaction() as cur:
            cur.execute(
                "INSERT INTO public.storm_work (run_key, pid) VALUES (%s, %s)",
                (ctx.run_key, os.getpid()),
            )
        if inside is not None:
            # Different keys: nobody leaves before all 32 are inside their work, and each
            # counts the advisory locks while all are held.
            inside.wait(BARRIER_TIMEOUT)
            row = ctx.connection.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            ).fetchone()
            observed["locks"] = int(row[0]) if row else -1
            counted.wait(BARRIER_TIMEOUT)
        else:
            time.sleep(1.0)  # the winner holds the key a moment: the others hit the lock
        return {"pid": os.getpid()}

    start.wait(BARRIER_TIMEOUT)
    began = time.perf_counter()
    try:
        result = run_idempotently(
            connect=lambda: psycopg.connect(dsn),
            job_name=JOB,
            run_key=run_key,
            work=work,
            lock_mode=lock_mode,
        )
        outcome = result.outcome.value
    except RunLockedError:
        outcome = "locked"
    except BaseException as exc:  # reported to the test, which fails on it
        outcome = f"error: {type(exc).__name__}: {exc}"
    results.put((os.getpid(), run_key, outcome, time.perf_counter() - began, observed))


def storm(
    dsn: str, keys: list[str], *, wait_inside: bool, lock_mode: str = "advisory"
) -> list[tuple[Any, ...]]:
    """Start one process per key, release them together, collect what each reports."""
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(len(keys))
    inside = ctx.Barrier(len(keys)) if wait_inside else None
    counted = ctx.Barrier(len(keys)) if wait_inside else None
    results = ctx.Queue()
    procs = [
        ctx.Process(target=contender, args=(dsn, key, start, inside, counted, results, lock_mode))
        for key in keys
    ]
    for proc in procs:
        proc.start()
    reported: list[Any] = []
    try:
        deadline = time.monotonic() + JOIN_TIMEOUT
        while len(reported) < len(keys):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"deadlock? only {len(reported)} of {len(keys)} reported"
            reported.append(results.get(timeout=remaining))
        for proc in procs:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.exitcode == 0, f"process {proc.pid} exit code {proc.exitcode}"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return reported


@pytest.fixture(scope="module")
def private_server() -> Iterator[Any]:
    """A private embedded PostgreSQL for the storms, stopped and removed afterwards."""
    from devtools.postgres import private_embedded

    with private_embedded("storm") as server:
        yield server


@pytest.fixture
def storm_dsn(private_server: Any) -> Iterator[str]:
    name = private_server.create_database("storm")
    dsn = private_server.dsn(name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_schema(conn)  # the storm is about the lock, not about 32 concurrent migrations
        conn.execute(
            "CREATE TABLE public.storm_work (run_key text, pid int, at timestamptz DEFAULT now())"
        )
    yield dsn
    private_server.drop_database(name)


def summary(seconds: list[float]) -> str:
    if not seconds:
        return "none"
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return (
        f"n={len(ordered)} min {ordered[0] * 1000:.1f} ms, median "
        f"{statistics.median(ordered) * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms, "
        f"max {ordered[-1] * 1000:.1f} ms"
    )


@pytest.mark.parametrize("lock_mode", ["advisory", "lease"])
def test_32_processes_on_one_key_run_the_work_exactly_once(storm_dsn: str, lock_mode: str) -> None:
    """32 processes released together on one (job, key): one runs the work, 31 are refused by the lock or find it completed, all 32 attempts are recorded and no lock is left."""
    keys = ["2026-10-01"] * PROCESSES
    reported = storm(storm_dsn, keys, wait_inside=False, lock_mode=lock_mode)
    outcomes = Counter(outcome for _, _, outcome, _, _ in reported)
    losers = [seconds for _, _, outcome, seconds, _ in reported if outcome != "completed"]
    winner = [seconds for _, _, outcome, seconds, _ in reported if outcome == "completed"]
    figures(
        f"{lock_mode} mode, same key: outcomes {dict(outcomes)}; winner {summary(winner)}; "
        f"losers {summary(losers)}"
    )
    assert lock_modes_used(storm_dsn) == {lock_mode}
    assert outcomes["completed"] == 1, outcomes
    assert outcomes["locked"] + outcomes["noop"] == PROCESSES - 1, outcomes
    assert rows(storm_dsn, "SELECT count(*) FROM public.storm_work") == [(1,)]
    recorded = Counter(
        o for (o,) in rows(storm_dsn, "SELECT outcome FROM idempotency.job_run_attempts")
    )
    assert recorded == Counter(
        {"completed": 1, "lock_held": outcomes["locked"], "noop": outcomes["noop"]}
    )
    assert rows(storm_dsn, "SELECT status, attempt_count FROM idempotency.job_runs") == [
        ("completed", 1)
    ]
    # Every refused attempt names the holder it met (the winner's backend).
    holders = rows(
        storm_dsn,
        "SELECT DISTINCT details->'holder'->'attempt'->>'pid' FROM idempotency.job_run_attempts"
        " WHERE outcome = 'lock_held'",
    )
    winner_pid = rows(
        storm_dsn, "SELECT pid FROM idempotency.job_run_attempts WHERE outcome = 'completed'"
    )[0][0]
    assert set(holders) <= {(str(winner_pid),), (None,)}, holders
    # A refusal is decided at once: nobody waits for the winner's 1 s of work.
    assert max(losers) < 30.0
    assert advisory_locks(storm_dsn, whole_server=True) == 0
    assert rows(storm_dsn, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]


def test_32_processes_on_32_keys_all_run_at_the_same_time(storm_dsn: str) -> None:
    """32 processes released together on 32 different keys: all 32 hold their lock and work at the same moment, all complete, and no lock is left."""
    keys = [f"2026-10-{day:02d}" for day in range(1, 31)] + ["2026-11-01", "2026-11-02"]
    reported = storm(storm_dsn, keys, wait_inside=True)
    outcomes = Counter(outcome for _, _, outcome, _, _ in reported)
    took = [seconds for _, _, _, seconds, _ in reported]
    figures(f"32 keys: outcomes {dict(outcomes)}; time in run_idempotently {summary(took)}")
    assert outcomes == Counter({"completed": PROCESSES}), outcomes
    # Each one saw all 32 locks held at once: no key waited for another.
    assert {observed["locks"] for _, _, _, _, observed in reported} == {PROCESSES}
    assert rows(storm_dsn, "SELECT count(DISTINCT run_key) FROM public.storm_work") == [
        (PROCESSES,)
    ]
    assert rows(storm_dsn, "SELECT status, count(*) FROM idempotency.job_runs GROUP BY status") == [
        ("completed", PROCESSES)
    ]
    assert advisory_locks(storm_dsn, whole_server=True) == 0
