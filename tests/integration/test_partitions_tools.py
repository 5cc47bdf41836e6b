"""The tools on partitioned and scheduled DAGs: `plan` over partitions (against `airflow
backfill create --dry-run`), `explain --partition-key`, `gaps` per segment and following a
DAG's schedule (real Airflow 3.3 parsing the DAG files, real PostgreSQL; no scheduler)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import TESTS
from support.cli import airflow_cli, cli, record
from support.workers import private_airflow_env

DAGS = TESTS / "dags_partitions"


def test_plan_over_partitions_is_what_backfill_create_would_run(
    airflow_home: Path, pg_dsn: str, tmp_path: Path
) -> None:
    """`plan` of a CronPartitionTimetable DAG over 10-01 .. 10-04 lists the partitions
    `airflow backfill create --dry-run` lists, each with its run key and what it would do;
    the other line's command is refused (Airflow 2 has no partitions)."""
    record(pg_dsn, "part_daily.work", "2026-10-02")
    record(pg_dsn, "part_daily.work", "2026-10-03", fail=True)
    env = private_airflow_env(airflow_home, pg_dsn, DAGS, home=tmp_path / "home")
    airflow = [sys.executable, "-m", "airflow"]
    subprocess.run([*airflow, "dags", "reserialize"], env=env, check=True, capture_output=True)
    dry = subprocess.run(
        [*airflow, "backfill", "create", "--dag-id", "part_daily", "--from-date", "2026-10-01",
         "--to-date", "2026-10-04", "--dry-run"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr[-3000:]
    planned = airflow_cli(
        airflow_home, pg_dsn, DAGS, "plan", "part_daily", "--from", "2026-10-01", "--to",
        "2026-10-04", "--json",
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-3000:]
    rows = [(r["partition_key"], r["run_key"], r["would"]) for r in json.loads(planned.stdout)]
    # Partition dates at 01:00 within the bounds (10-04 00:00 is before 10-04 01:00).
    assert rows == [
        ("2026-10-01T01:00:00", "2026-10-01", "new"),
        ("2026-10-02T01:00:00", "2026-10-02", "noop"),
        ("2026-10-03T01:00:00", "2026-10-03", "rerun"),
    ]
    for partition_key, _, _ in rows:
        assert partition_key in dry.stdout, dry.stdout
    assert "2026-10-04T01:00:00" not in dry.stdout
    other = airflow_cli(
        airflow_home, pg_dsn, DAGS, "plan", "part_daily", "--from", "2026-10-01", "--to",
        "2026-10-04", "--command", "dags-backfill",
    )  # fmt: skip
    assert other.returncode == 2 and "Airflow 2 has no partitioned runs" in other.stderr


def test_plan_of_a_mapped_task_lists_each_segment(airflow_home: Path, pg_dsn: str) -> None:
    """A task mapped over regions plans one key per region and partition."""
    planned = airflow_cli(
        airflow_home, pg_dsn, DAGS, "plan", "part_mapped", "--from", "2026-10-01T01:00:00",
        "--to", "2026-10-01T01:00:00", "--json",
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert [r["run_key"] for r in json.loads(planned.stdout)] == [
        "eu|2026-10-01",
        "us|2026-10-01",
        "apac|2026-10-01",
    ]


def test_explain_a_partition_key(airflow_home: Path, pg_dsn: str) -> None:
    """`explain --partition-key` shows the run key a partition gives and why, or the refusal
    of a malformed key (exit 2) and of a conf run_key that contradicts the partition."""
    good = airflow_cli(
        airflow_home, pg_dsn, DAGS, "explain", "part_daily", "--run-type", "backfill",
        "--partition-key", "2026-10-01T01:00:00", "--json",
    )  # fmt: skip
    assert good.returncode == 0, good.stderr[-3000:]
    (row,) = json.loads(good.stdout)
    assert row["run_key"] == "2026-10-01"
    assert "from the run's partition_key '2026-10-01T01:00:00'" in row["explanation"]
    bad = airflow_cli(
        airflow_home, pg_dsn, DAGS, "explain", "part_runtime", "--run-type", "manual",
        "--partition-key", "eu|2026-13-01", "--json",
    )  # fmt: skip
    assert bad.returncode == 2 and "written like a time but is none" in bad.stdout
    conflict = airflow_cli(
        airflow_home, pg_dsn, DAGS, "explain", "part_runtime", "--run-type", "manual",
        "--partition-key", "eu|2026-10-01", "--conf", '{"run_key": "eu|2026-10-02"}', "--json",
    )  # fmt: skip
    assert conflict.returncode == 2 and "contradicts the run's partition_key" in conflict.stdout


def test_gaps_per_segment(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`gaps` of a segmented job lists each segment's missing periods, or one segment's."""
    for key in ("eu|2026-10-01", "eu|2026-10-03", "us|2026-10-01", "us|2026-10-02"):
        record(pg_dsn, "regional", key)
    record(pg_dsn, "regional", "us|2026-10-03", fail=True)
    args = ("gaps", "regional", "--from", "2026-10-01", "--to", "2026-10-03", "--dsn", pg_dsn)
    code, found, _ = cli(capsys, *args)
    assert code == 1
    assert [(g["run_key"], g["state"]) for g in found] == [
        ("eu|2026-10-02", "missing"),
        ("us|2026-10-03", "failed"),
    ]
    code, found, _ = cli(capsys, *args, "--segment", "eu")
    assert [g["run_key"] for g in found] == ["eu|2026-10-02"]
    code, found, err = cli(capsys, *args, "--segment", "*|*")
    assert code == 2 and "one '*'" in err


def test_gaps_follow_the_dags_schedule(
    airflow_home: Path, pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job run Tuesday to Saturday for the weekdays before: with --dag its weekend is no
    gap (only the missing Wednesday is); without, every ended day of the week is a period."""
    for day in ("2026-10-05", "2026-10-06", "2026-10-08", "2026-10-09"):  # Mon..Fri, no Wed
        record(pg_dsn, "weekday_job.work", day)
    args = ("gaps", "weekday_job.work", "--from", "2026-10-05", "--to", "2026-10-11")
    followed = airflow_cli(
        airflow_home, pg_dsn, DAGS, *args, "--dag", "weekday_job", "--dags-folder", str(DAGS),
        "--json",
    )  # fmt: skip
    assert followed.returncode == 1, followed.stderr[-3000:]
    assert [g["run_key"] for g in json.loads(followed.stdout)] == ["2026-10-07"]
    _, found, _ = cli(capsys, *args, "--dsn", pg_dsn)
    assert [g["run_key"] for g in found] == ["2026-10-07", "2026-10-10", "2026-10-11"]


def test_a_period_not_yet_ended_is_no_gap(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """gaps up to today lists yesterday (ended, missing) but not today (not ended)."""
    import datetime as dt

    today = dt.datetime.now(dt.timezone.utc).date()
    record(pg_dsn, "daily", (today - dt.timedelta(days=2)).isoformat())
    code, found, _ = cli(
        capsys, "gaps", "daily", "--from", (today - dt.timedelta(days=2)).isoformat(), "--to",
        today.isoformat(), "--dsn", pg_dsn,
    )  # fmt: skip
    assert code == 1
    assert [g["run_key"] for g in found] == [(today - dt.timedelta(days=1)).isoformat()]
