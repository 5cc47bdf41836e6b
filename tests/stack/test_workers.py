"""Several OS processes running ``airflow dags test`` against one job database.

These prove the lock and crash guarantees with real Airflow worker processes: overlap of
one run key is blocked, different keys run in parallel, and a SIGKILLed worker's key is
free at once and converges on the rerun.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support.db import rows
from support.locks import advisory_locks, lock_held_attempts
from support.workers import Until, kill_group, race, start_worker, wait_until, work_log_count

pytestmark = pytest.mark.both_airflow_lines


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


@pytest.mark.parametrize(
    ("policy", "loser_exit", "loser_state"),
    [("fail", 1, "failed"), ("skip", 0, "skipped"), ("reschedule", 0, "success")],
)
def test_same_key_in_two_processes_runs_once(
    airflow_home: Path, pg_dsn: str, tmp_path: Path, policy: str, loser_exit: int, loser_state: str
) -> None:
    """Two workers start one run key together: the work runs once; the other fails, skips, or waits and no-ops."""
    release = tmp_path / "release"
    env = {"IDEM_TEST_HOLD_FILE": str(release), "IDEM_TEST_ON_LOCKED": policy}
    first, second = race(
        lambda: start_worker(airflow_home, "core_slow_job", "2026-10-02", pg_dsn, env),
        lambda: start_worker(airflow_home, "core_slow_job", "2026-10-02", pg_dsn, env),
        release,
        first_holds=Until(lambda: work_log_count(pg_dsn) == 1, "the first worker to start working"),
        second_refused=Until(
            lambda: lock_held_attempts(pg_dsn), "the second worker to find the key locked"
        ),
        wait=90,
    )
    assert first.returncode == 0, first.output[-3000:]
    assert second.returncode == loser_exit, second.output[-3000:]
    assert work_log_count(pg_dsn) == 1
    assert "is locked by another execution: backend pid" in second.output
    outcomes = [
        o
        for (o,) in rows(
            pg_dsn, "SELECT outcome FROM idempotency.job_run_attempts ORDER BY attempt_id"
        )
    ]
    assert outcomes[0] == "completed" and "lock_held" in outcomes[1:]
    if policy == "reschedule":
        # It waited without using a retry, then found the key completed.
        assert outcomes[-1] == "noop"
        assert rows(pg_dsn, "SELECT max(try_number) FROM idempotency.job_run_attempts") == [(1,)]
    assert advisory_locks(pg_dsn) == 0


def test_lock_timeout_gives_up_rescheduling(
    airflow_home: Path, pg_dsn: str, tmp_path: Path
) -> None:
    """A key held longer than lock_timeout: the waiting task reschedules (waiting each
    interval, without using a retry) and then fails its try, naming lock_timeout."""
    release = tmp_path / "release"
    env = {"IDEM_TEST_HOLD_FILE": str(release)}
    holder = start_worker(airflow_home, "core_slow_job", "2026-10-02", pg_dsn, env)
    try:
        wait_until(lambda: work_log_count(pg_dsn) == 1, timeout=90, what="the holder to work")
        waiter_env = {**env, "IDEM_TEST_ON_LOCKED": "reschedule", "IDEM_TEST_LOCK_TIMEOUT": "4"}
        waiter = start_worker(airflow_home, "core_slow_job", "2026-10-02", pg_dsn, waiter_env)
        code, out = finish(waiter)
        release.touch()
        holder_code, holder_out = finish(holder)
    finally:
        kill_group(holder)
    assert code == 1, out[-3000:]
    assert "lock_timeout=0:00:04" in out and "giving up this try" in out, out[-3000:]
    assert holder_code == 0, holder_out[-3000:]
    refused = rows(
        pg_dsn,
        "SELECT started_at FROM idempotency.job_run_attempts WHERE outcome = 'lock_held'"
        " ORDER BY attempt_id",
    )
    # Rescheduled every second (reschedule_interval) until ~4 s had passed: not a tight loop
    # of immediate retries, and not forever.
    assert 4 <= len(refused) <= 8, refused
    spread = (refused[-1][0] - refused[0][0]).total_seconds()
    assert spread >= 3.5, refused
    assert work_log_count(pg_dsn) == 1


def test_different_keys_run_in_parallel(airflow_home: Path, pg_dsn: str, tmp_path: Path) -> None:
    """Two workers on different dates both hold their lock and work at the same time."""
    release = tmp_path / "release"
    env = {"IDEM_TEST_HOLD_FILE": str(release), "IDEM_TEST_ON_LOCKED": "fail"}
    procs = [
        start_worker(airflow_home, "core_slow_job", d, pg_dsn, env)
        for d in ("2026-10-02", "2026-10-03")
    ]
    try:
        try:
            wait_until(
                lambda: work_log_count(pg_dsn) == 2, timeout=120, what="both workers to be working"
            )
        except AssertionError as exc:
            for p in procs:
                kill_group(p)
            tails = [p.stdout.read()[-3000:] if p.stdout else "" for p in procs]
            raise AssertionError(f"{exc}; worker output:\n" + "\n-----\n".join(tails)) from exc
        assert advisory_locks(pg_dsn) == 2
        release.touch()
        results = [finish(p) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    assert [code for code, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    spans = rows(
        pg_dsn,
        "SELECT run_key, started_at, finished_at FROM idempotency.job_run_attempts ORDER BY run_key",
    )
    (_, s1, f1), (_, s2, f2) = spans
    assert s1 < f2 and s2 < f1  # the two executions overlapped in time


def test_sigkill_mid_work_frees_the_lock_and_rerun_converges(
    airflow_home: Path, pg_dsn: str
) -> None:
    """A worker SIGKILLed mid-work: lock free at once, job_runs says started, the rerun completes it."""
    victim = start_worker(
        airflow_home, "core_slow_job", "2026-10-02", pg_dsn, {"IDEM_TEST_SLEEP": "120"}
    )
    try:
        wait_until(
            lambda: work_log_count(pg_dsn) == 1, timeout=90, what="the worker to start working"
        )
        assert advisory_locks(pg_dsn) == 1
    finally:
        kill_group(victim)
    wait_until(
        lambda: advisory_locks(pg_dsn) == 0,
        timeout=5,
        what="Postgres to release the dead worker's lock",
    )
    assert rows(pg_dsn, "SELECT status FROM idempotency.job_runs") == [("started",)]
    assert rows(pg_dsn, "SELECT outcome FROM idempotency.job_run_attempts") == [("running",)]

    rerun = start_worker(
        airflow_home, "core_slow_job", "2026-10-02", pg_dsn, {"IDEM_TEST_SLEEP": "0"}
    )
    code, out = finish(rerun)
    assert code == 0, out[-3000:]
    assert rows(pg_dsn, "SELECT status, attempt_count FROM idempotency.job_runs") == [
        ("completed", 2)
    ]
    assert work_log_count(pg_dsn) == 2
