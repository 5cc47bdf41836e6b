"""The on-call engineer's commands against a real job database and real DAGs: gaps, stale
work, retention, what a run's key would be (explain), what a backfill would do (plan), and
the example watch DAG that turns gaps into a failed task."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS
from devtools.airflow_env import DAGS_FOLDER
from support.cli import abandon, airflow_cli, cli, cli_process_with, record
from support.dag_runs import FAILED, SUCCESS, load_dag_bag, run_dag, utc
from support.db import rows
from support.locks import key_held
from support.workers import TEST_DAGS, private_airflow_env

pytestmark = pytest.mark.both_airflow_lines


def test_gaps_lists_periods_without_a_completed_run(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gaps` over five days: the failed, the missing and the abandoned day, in order, exit 1;
    a range with none exits 0; an unknown job, a reversed or malformed range exit 2."""
    record(pg_dsn, "j", "2026-10-01")
    record(pg_dsn, "j", "2026-10-02", fail=True)
    record(pg_dsn, "j", "2026-10-04")
    abandon(pg_dsn, "j", "2026-10-05")
    code, found, _ = cli(
        capsys, "gaps", "j", "--from", "2026-10-01", "--to", "2026-10-05", "--dsn", pg_dsn
    )
    assert code == 1
    assert [(g["run_key"], g["state"]) for g in found] == [
        ("2026-10-02", "failed"),
        ("2026-10-03", "missing"),
        ("2026-10-05", "started"),
    ]
    assert "2026-10-02 broke" in found[0]["last_error"]
    code, found, _ = cli(
        capsys, "gaps", "j", "--from", "2026-10-01", "--to", "2026-10-01", "--dsn", pg_dsn
    )
    assert (code, found) == (0, [])
    code, _, err = cli(
        capsys, "gaps", "typo", "--from", "2026-10-01", "--to", "2026-10-02", "--dsn", pg_dsn
    )
    assert code == 2 and "no job named 'typo'" in err and "jobs: j" in err
    code, _, err = cli(
        capsys, "gaps", "j", "--from", "2026-10-05", "--to", "2026-10-01", "--dsn", pg_dsn
    )
    assert code == 2 and "first key comes after the last" in err
    code, _, err = cli(
        capsys, "gaps", "j", "--from", "2026-13-01", "--to", "2026-10-01", "--dsn", pg_dsn
    )
    assert code == 2 and "2026-13-01" in err
    code, found, _ = cli(
        capsys, "gaps", "m", "--from", "2026-09", "--to", "2026-11", "--dsn", pg_dsn
    )
    assert code == 2  # job m never ran: refused, not reported as all missing


def test_runs_stale_finds_abandoned_work(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`runs --stale`: a killed worker's key (started, attempt running, no lock holder) is
    listed with its age, exit 1; a key being worked on now is not; after a rerun, none."""
    record(pg_dsn, "j", "2026-10-01")
    abandon(pg_dsn, "j", "2026-10-02")
    with key_held(pg_dsn, "j", "2026-10-03"):
        code, found, _ = cli(capsys, "runs", "--stale", "--dsn", pg_dsn)
    assert code == 1
    assert [(r["run_key"], r["status"]) for r in found] == [("2026-10-02", "started")]
    assert found[0]["attempt_id"] is not None and found[0]["age"].endswith("ago")
    record(pg_dsn, "j", "2026-10-02")  # the rerun takes it over
    code, found, _ = cli(capsys, "runs", "--stale", "--dsn", pg_dsn)
    assert (code, found) == (0, [])


def test_prune_deletes_old_attempts_of_completed_keys_only(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`prune --attempts-older-than 400d`: old attempts of completed keys go (in batches),
    the attempt that completed each key, other keys' attempts and every job_runs row stay."""
    for _ in range(3):
        record(pg_dsn, "j", "2026-10-01")  # completed + 2 noops
    record(pg_dsn, "j", "2026-10-02", fail=True)  # not completed: kept whatever its age
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE idempotency.job_run_attempts SET started_at = now() - interval '500 days'"
        )
    code, summary, _ = cli(
        capsys, "prune", "--attempts-older-than", "400d", "--dry-run", "--dsn", pg_dsn
    )
    assert (code, summary["attempts"]) == (0, 2)
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.job_run_attempts") == [(4,)]
    code, summary, _ = cli(
        capsys, "prune", "--attempts-older-than", "400d", "--batch-size", "1", "--dsn", pg_dsn
    )
    assert (code, summary["attempts"]) == (0, 2)
    assert rows(
        pg_dsn, "SELECT run_key, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id"
    ) == [("2026-10-01", "completed"), ("2026-10-02", "failed")]
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.job_runs") == [(2,)]
    code, _, err = cli(capsys, "prune", "--attempts-older-than", "1y", "--dsn", pg_dsn)
    assert code == 2 and "400d" in err


def test_explain_names_the_key_and_why_or_the_refusal(airflow_home: Path, pg_dsn: str) -> None:
    """`explain` reads the DAG's timetable and rule: the key a scheduled, manual or backfill
    run would get and why; a refused one exits 2 with the reason; bad input exits 2."""

    def explain(*argv: str) -> tuple[int, Any, str]:
        done = airflow_cli(
            airflow_home, pg_dsn, TEST_DAGS, "explain", "core_slow_job", *argv, "--json"
        )
        return (
            done.returncode,
            json.loads(done.stdout) if done.stdout.strip() else None,
            done.stderr,
        )

    code, found, err = explain("--logical-date", "2026-10-02")
    assert code == 0, err
    (task,) = found
    assert (task["job_name"], task["run_key"]) == ("core_slow_job", "2026-10-01")
    assert "offset -1" in task["explanation"] and "CronTriggerTimetable" in task["explanation"]
    code, found, _ = explain(
        "--run-type",
        "manual",
        "--logical-date",
        "2026-10-20",
        "--conf",
        '{"run_key": "2026-09-15"}',
    )
    assert (code, found[0]["run_key"]) == (0, "2026-09-15")
    code, found, _ = explain(
        "--run-type",
        "backfill",
        "--logical-date",
        "2026-10-20",
        "--conf",
        '{"run_key": "2026-09-15"}',
    )
    assert (
        code == 2 and found[0]["run_key"] is None and "only manual runs" in found[0]["explanation"]
    )
    tomorrow = (dt.date.today() + dt.timedelta(days=2)).isoformat()
    code, found, _ = explain("--logical-date", tomorrow)
    assert code == 2 and "has not ended yet" in found[0]["explanation"]
    if AIRFLOW_V_3_0_PLUS:  # Airflow 2 has no run without a logical date
        code, found, _ = explain("--run-type", "manual")
        assert code == 2 and "no logical date and no run_key" in found[0]["explanation"]
    code, _, err = explain("--conf", "{not json")
    assert code == 2 and "--conf is not JSON" in err
    unknown = airflow_cli(
        airflow_home, pg_dsn, TEST_DAGS, "explain", "no_such_dag", "--logical-date", "2026-10-02"
    )
    assert unknown.returncode == 2 and "no DAG 'no_such_dag'" in unknown.stderr
    assert "core_slow_job" in unknown.stderr  # names the DAGs that are there


def test_plan_shows_what_a_backfill_would_do_date_by_date(
    airflow_home: Path, invoicing: Any
) -> None:
    """`plan` of the example's reconciliation DAG over 10-01 .. 10-03 (midnights): the
    business dates this line's backfill command covers, each with what it would do: a
    completed date is a no-op, a failed one a rerun, one never run new; and the same for
    the other Airflow line's command, as that line would run it."""
    record(invoicing.dsn, "daily_reconciliation", "2026-10-01")
    record(invoicing.dsn, "daily_reconciliation", "2026-09-30", fail=True)

    def plan(start: str, end: str, *more: str) -> subprocess.CompletedProcess[str]:
        argv = ("plan", "daily_reconciliation", "--from", start, "--to", end, *more)
        return airflow_cli(airflow_home, invoicing.dsn, DAGS_FOLDER, *argv)

    done = plan("2026-10-01", "2026-10-03", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    planned = [(r["run_key"], r["would"]) for r in json.loads(done.stdout)]
    # backfill create (3.x): runs fired 10-01 01:30 and 10-02 01:30, i.e. the days before.
    # dags backfill (2.x): logical dates 10-01 01:30 and 10-02 01:30 are those days.
    by_command = {
        "backfill-create": [("2026-09-30", "rerun"), ("2026-10-01", "noop")],
        "dags-backfill": [("2026-10-01", "noop"), ("2026-10-02", "new")],
    }
    this, other = (
        ("backfill-create", "dags-backfill")
        if AIRFLOW_V_3_0_PLUS
        else ("dags-backfill", "backfill-create")
    )
    assert planned == by_command[this]
    # The other line's command, answered here for that line's timetable of the cron string.
    for_other = plan("2026-10-01", "2026-10-03", "--command", other, "--json")
    assert for_other.returncode == 0, for_other.stderr[-3000:]
    assert [(r["run_key"], r["would"]) for r in json.loads(for_other.stdout)] == by_command[other]
    reversed_range = plan("2026-10-03", "2026-10-01")
    assert reversed_range.returncode == 2 and "is after --to" in reversed_range.stderr


@pytest.mark.skipif(not AIRFLOW_V_3_0_PLUS, reason="airflow backfill create is Airflow 3's")
def test_plan_agrees_with_airflow_backfill_create(
    airflow_home: Path, invoicing: Any, tmp_path: Path
) -> None:
    """The dates `plan` shows are the runs `airflow backfill create --dry-run` would create."""
    env = private_airflow_env(airflow_home, invoicing.dsn, DAGS_FOLDER, home=tmp_path / "home")
    airflow = [sys.executable, "-m", "airflow"]
    subprocess.run([*airflow, "dags", "reserialize"], env=env, check=True, capture_output=True)
    dry = subprocess.run(
        [
            *airflow,
            "backfill",
            "create",
            "--dag-id",
            "finalize_invoices",
            "--from-date",
            "2026-10-01",
            "--to-date",
            "2026-10-04",
            "--dry-run",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dry.returncode == 0, dry.stderr[-3000:]
    plan = cli_process_with(
        env, "plan", "finalize_invoices", "--from", "2026-10-01", "--to", "2026-10-04", "--json"
    )
    assert plan.returncode == 0, plan.stderr[-3000:]
    planned = sorted({r["logical_date"][:16] for r in json.loads(plan.stdout)})
    assert planned == ["2026-10-01T01:00", "2026-10-02T01:00", "2026-10-03T01:00"]
    for logical_date in planned:
        assert logical_date.replace("T", " ") in dry.stdout, dry.stdout


def test_watch_dag_fails_on_a_gap_and_passes_when_filled(
    airflow_home: Path, airflow_pg_conn: str
) -> None:
    """The example watch DAG over the 4 days before its run's date (a run for 2026-11-01,
    as a backfill would make, not the days before today): a missing and a stale day fail
    its task (the problems it names are checked too); once completed, it succeeds."""
    dag = load_dag_bag(DAGS_FOLDER).dags["idempotency_watch"]
    days = ["2026-10-31", "2026-10-30", "2026-10-29", "2026-10-28"]
    for key in days[::2]:
        record(airflow_pg_conn, "watched", key)
    abandon(airflow_pg_conn, "watched", days[1])
    conf = {"dags": [], "jobs": ["watched"], "days": 4}
    failed = run_dag(dag, logical_date=utc(2026, 11, 1, 6), conf=conf)
    assert failed.state == FAILED
    from airflow_idempotency import gaps

    with psycopg.connect(airflow_pg_conn, autocommit=True) as conn:
        named = gaps.problems(conn, "idempotency", ["watched"], days[-1], days[0])
    assert [p.split(":")[0] for p in named] == [
        f"watched {days[3]}",
        f"watched {days[1]}",
        f"watched {days[1]}",
    ], named  # days[3] missing; days[1] started, and stale
    assert "missing" in named[0] and "started" in named[1] and "stale since" in named[2]
    for key in days[1::2]:
        record(airflow_pg_conn, "watched", key)
    assert run_dag(dag, logical_date=utc(2026, 11, 1, 6), conf=conf).state == SUCCESS
