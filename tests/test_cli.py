"""The operator CLI against a real job database, and `run` through real Airflow processes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_idempotency import RunContext, run_idempotently
from airflow_idempotency.cli import main
from workers import kill_group, private_airflow_env, start_worker, wait_until

pytestmark = pytest.mark.both_airflow_lines


def complete(dsn: str, job: str, key: str, fail: bool = False) -> None:
    def work(run: RunContext) -> dict[str, int]:
        if fail:
            raise RuntimeError("boom")
        return {"n": 1}

    with contextlib.suppress(RuntimeError):
        run_idempotently(connect=lambda: psycopg.connect(dsn), job_name=job, run_key=key, work=work)


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    # Only what the command prints: the runs made above log to stdout on Airflow 2.
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_runs_show_and_filters(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`runs` lists and filters job runs; `show` gives a run with every attempt."""
    complete(pg_dsn, "job_a", "2026-10-01")
    complete(pg_dsn, "job_a", "2026-10-01")
    complete(pg_dsn, "job_a", "2026-10-02", fail=True)
    complete(pg_dsn, "job_b", "2026-10-03")
    runs = cli_json(capsys, "runs", "--dsn", pg_dsn)
    assert [(r["job_name"], r["run_key"], r["status"]) for r in runs] == [
        ("job_b", "2026-10-03", "completed"),
        ("job_a", "2026-10-02", "failed"),
        ("job_a", "2026-10-01", "completed"),
    ]
    failed = cli_json(capsys, "runs", "--dsn", pg_dsn, "--status", "failed")
    assert [r["run_key"] for r in failed] == ["2026-10-02"]
    window = cli_json(
        capsys,
        "runs",
        "--dsn",
        pg_dsn,
        "--job",
        "job_a",
        "--from",
        "2026-10-01",
        "--to",
        "2026-10-01",
    )
    assert [r["run_key"] for r in window] == ["2026-10-01"]
    shown = cli_json(capsys, "show", "job_a", "2026-10-01", "--dsn", pg_dsn)
    assert [a["outcome"] for a in shown["attempts"]] == ["completed", "noop"]
    assert main(["runs", "--dsn", pg_dsn]) == 0  # the human table renders
    assert "job_a" in capsys.readouterr().out


def test_reset_failed_run_records_reason(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`reset` marks a failed run with the reason and records a reset attempt; a completed one is refused."""
    complete(pg_dsn, "job", "2026-10-02", fail=True)
    assert (
        main(
            [
                "reset",
                "job",
                "2026-10-02",
                "--reason",
                "upstream file re-delivered",
                "--dsn",
                pg_dsn,
            ]
        )
        == 0
    )
    assert "reset job 2026-10-02 to failed" in capsys.readouterr().out
    shown = cli_json(capsys, "show", "job", "2026-10-02", "--dsn", pg_dsn)
    assert shown["run"]["details"]["reset_reason"] == "upstream file re-delivered"
    assert shown["attempts"][-1]["outcome"] == "reset"
    complete(pg_dsn, "job", "2026-10-03")
    assert main(["reset", "job", "2026-10-03", "--reason", "x", "--dsn", pg_dsn]) == 1


def test_ledger_and_locks_views(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`ledger` shows pending effects; `locks` shows who holds a run key right now."""
    complete(pg_dsn, "job", "2026-10-01")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO idempotency.outbound_ledger (remote_system, idempotency_key, job_name, run_key, request_fingerprint)"
            " VALUES ('accounting', 'job:2026-10-01:1', 'job', '2026-10-01', 'abc')"
        )
    ledger = cli_json(capsys, "ledger", "--dsn", pg_dsn)
    assert ledger["summary"][0]["status"] == "pending" and ledger["summary"][0]["effects"] == 1
    assert ledger["not_confirmed"][0]["idempotency_key"] == "job:2026-10-01:1"

    import threading

    inside, release = threading.Event(), threading.Event()

    def hold(run: RunContext) -> None:
        inside.set()
        release.wait(10)

    t = threading.Thread(
        target=lambda: run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn), job_name="job", run_key="2026-10-09", work=hold
        )
    )
    t.start()
    try:
        assert inside.wait(10)
        locks = cli_json(capsys, "locks", "--dsn", pg_dsn)
        assert [(lk["job_name"], lk["run_key"], lk["status"]) for lk in locks] == [
            ("job", "2026-10-09", "started")
        ]
        assert locks[0]["worker_pid"] == os.getpid()
        assert main(["reset", "job", "2026-10-09", "--reason", "stuck?", "--dsn", pg_dsn]) == 75
    finally:
        release.set()
        t.join()


@pytest.mark.parametrize("bad", ["2026-13-01", "yesterday", "2026-10-1"])
def test_run_refuses_malformed_dates_with_usage(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run` with a malformed date exits 2 and prints the usage."""
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "core_slow_job", "--date", bad, "--dsn", "host=/nonexistent"])
    assert exit_info.value.code == 2
    assert "YYYY-MM-DD" in capsys.readouterr().err


def test_run_requires_a_date(capsys: pytest.CaptureFixture[str]) -> None:
    """`run` without --date exits 2 with the usage."""
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "core_slow_job"])
    assert exit_info.value.code == 2
    assert "--date" in capsys.readouterr().err


def cli_process(airflow_home: Path, dsn: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = private_airflow_env(airflow_home, dsn)
    return subprocess.run(
        [sys.executable, "-m", "airflow_idempotency.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_run_exit_codes_through_airflow(airflow_home: Path, pg_dsn: str, tmp_path: Path) -> None:
    """`run`: 0 when it completes, 0 (no-op) when completed already, 1 on failure, 75 when locked elsewhere."""
    first = cli_process(airflow_home, pg_dsn, "run", "core_slow_job", "--date", "2026-10-01")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "completed" in first.stdout
    again = cli_process(airflow_home, pg_dsn, "run", "core_slow_job", "--date", "2026-10-01")
    assert again.returncode == 0 and "no-op: already completed" in again.stdout
    future = cli_process(airflow_home, pg_dsn, "run", "core_slow_job", "--date", "2099-01-01")
    assert future.returncode == 2 and "has not ended yet" in future.stderr  # refused input
    assert "nothing ran" in future.stderr

    release = tmp_path / "release"
    holder = start_worker(
        airflow_home, "core_slow_job", "2026-10-03", pg_dsn, {"IDEM_TEST_HOLD_FILE": str(release)}
    )
    try:
        wait_until(
            lambda: (
                psycopg.connect(pg_dsn)
                .execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                )
                .fetchone()[0]
            ),  # type: ignore[index]
            timeout=90,
            what="the holder to take the lock",
        )
        locked = cli_process(
            airflow_home, pg_dsn, "run", "core_slow_job", "--date", "2026-10-02", "--json"
        )
        # Read through the Airflow connection (no --dsn): Airflow is imported and logs, and
        # stdout must still hold the JSON only.
        listed = cli_process(airflow_home, pg_dsn, "runs", "--json")
    finally:
        release.touch()
        holder.communicate(timeout=120)
        kill_group(holder)
    assert locked.returncode == 75, locked.stdout + locked.stderr
    assert json.loads(locked.stdout)["verdict"] == "locked elsewhere"
    assert listed.returncode == 0, listed.stdout + listed.stderr
    keys = {(r["run_key"], r["status"]) for r in json.loads(listed.stdout)}
    assert {("2026-10-01", "completed"), ("2026-10-02", "started")} <= keys  # holder runs
