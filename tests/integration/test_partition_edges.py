"""Partitions at their edges (issue 31, item 2), on Airflow 3.3's own timetable code: an
hourly CronPartitionTimetable in Europe/Amsterdam over a whole year (both 02:00 hours of the
autumn change are two keys, the spring gap leaves no hole), keyed by the operator from the
partition's exact instant as the task context gives it; and `plan`, `gaps` and the watch
agree with when each partition's run fires (run_offset, weekday crons)."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pendulum
import psycopg
import pytest

from airflow_idempotency import IdempotentRunOperator, RunKeyRule, planning
from airflow_idempotency.compat import AIRFLOW_V_3_2_PLUS
from airflow_idempotency.exceptions import InvalidRunKeyError
from airflow_idempotency.gaps import gaps as find_gaps
from support import TESTS
from support.cli import airflow_cli, record

pytestmark = pytest.mark.skipif(not AIRFLOW_V_3_2_PLUS, reason="partitioned runs: Airflow 3.2+")

AMSTERDAM = "Europe/Amsterdam"


def partitioned_dag(dag_id: str, cron: str, period: str = "hour", **timetable: Any) -> Any:
    from airflow.sdk import DAG, CronPartitionTimetable

    with DAG(
        dag_id,
        schedule=CronPartitionTimetable(cron, timezone=AMSTERDAM, run_offset=-1, **timetable),
        start_date=pendulum.datetime(2025, 1, 1, tz=AMSTERDAM),
    ) as dag:
        IdempotentRunOperator(
            task_id="work",
            python_callable=lambda run: None,
            run_key_rule=RunKeyRule(period=period),  # type: ignore[arg-type]
        )
    return dag


def task_context(partition_key: str, partition_date: dt.datetime | None) -> dict[str, Any]:
    """What a scheduled task of a partitioned run reads (Task SDK's dag_run fields)."""
    dag_run = SimpleNamespace(
        conf={},
        run_type="scheduled",
        logical_date=None,
        partition_key=partition_key,
        partition_date=partition_date,
    )
    return {"dag_run": dag_run, "params": {}, "logical_date": None}


def test_every_hour_of_a_year_in_amsterdam_is_its_own_key() -> None:
    """The scheduler's 8,760 hourly runs of a year in Europe/Amsterdam get 8,760 keys, each
    the UTC hour of its partition instant: the two runs Airflow keys '2026-10-25T02:00:00'
    are 00Z and 01Z, and the spring night (no 02:00) has no hole in its keys."""
    dag = partitioned_dag("edges_hourly", "0 * * * *")
    (task,) = dag.tasks
    runs = planning.scheduled_runs(
        dag,
        pendulum.datetime(2025, 11, 1, tz="UTC"),  # a year, both changes of 2026 in it
        pendulum.datetime(2026, 10, 31, 23, tz="UTC"),
    )
    assert len(runs) == 8760
    keys = []
    for run in runs:
        assert run.partition_key is not None and run.partition_date is not None
        resolved = task.resolve_run_key(task_context(run.partition_key, run.partition_date))
        keys.append(resolved.run_key)
        assert resolved.run_key == f"{run.partition_date.astimezone(dt.timezone.utc):%Y-%m-%dT%HZ}"
    assert len(set(keys)) == len(keys)
    instants = [dt.datetime.strptime(k, "%Y-%m-%dT%HZ") for k in keys]
    assert all(b - a == dt.timedelta(hours=1) for a, b in itertools.pairwise(instants))
    autumn = [
        k for r, k in zip(runs, keys, strict=True) if r.partition_key == "2026-10-25T02:00:00"
    ]
    assert autumn == ["2026-10-25T00Z", "2026-10-25T01Z"]
    spring = [r.partition_key for r in runs if (r.partition_key or "").startswith("2026-03-29T0")]
    assert "2026-03-29T02:00:00" not in spring
    assert {"2026-03-29T00Z", "2026-03-29T01Z"} <= set(keys)  # 01:00 CET, 03:00 CEST


def test_an_autumn_hour_without_its_instant_is_refused_naming_both_keys() -> None:
    """A partition key of the repeated hour without a partition date (explain, a key typed
    by hand) names no single hour: refused, naming both keys; the spring's missing 02:00
    names none; a daily job keys both to their day."""
    dag = partitioned_dag("edges_refused", "0 * * * *")
    (task,) = dag.tasks
    with pytest.raises(InvalidRunKeyError, match=r"'2026-10-25T00Z'.*'2026-10-25T01Z'"):
        task.resolve_run_key(task_context("2026-10-25T02:00:00", None))
    with pytest.raises(InvalidRunKeyError, match="does not exist in Europe/Amsterdam"):
        task.resolve_run_key(task_context("2026-03-29T02:00:00", None))
    daily = partitioned_dag("edges_daily_of_hours", "0 * * * *", period="day")
    (day_task,) = daily.tasks
    assert day_task.resolve_run_key(task_context("2026-10-25T02:00:00", None)).run_key == (
        "2026-10-25"
    )


def test_plan_of_the_autumn_night_lists_both_hours() -> None:
    """`plan` over the autumn night lists the two runs a backfill creates for
    '2026-10-25T02:00:00' (Airflow 3.3 tells them apart by partition date) with two keys."""
    dag = partitioned_dag("edges_plan", "0 * * * *")
    rows = planning.plan(
        dag,
        None,
        "idempotency",
        pendulum.datetime(2026, 10, 25, 1, tz="UTC"),  # read as 01:00 Amsterdam by Airflow
        pendulum.datetime(2026, 10, 25, 3, tz="UTC"),
    )
    assert [(r["partition_key"], r["run_key"], r["would"]) for r in rows] == [
        ("2026-10-25T01:00:00", "2026-10-24T23Z", "new"),
        ("2026-10-25T02:00:00", "2026-10-25T00Z", "new"),
        ("2026-10-25T02:00:00", "2026-10-25T01Z", "new"),
        ("2026-10-25T03:00:00", "2026-10-25T02Z", "new"),
    ]


def test_a_partition_is_due_when_its_run_fires() -> None:
    """run_offset=-1: the partition of 10-04 is run at 10-05 01:00 Amsterdam. At 00:30 it
    is not due yet (a backfill would say its run is at the partition date, 10-04 01:00);
    at 01:00 it is."""
    dag = partitioned_dag("edges_offset", "0 1 * * *", period="day")
    first = pendulum.datetime(2026, 10, 1, tz=AMSTERDAM)
    before = planning.due_keys(dag, first, pendulum.datetime(2026, 10, 5, 0, 30, tz=AMSTERDAM))
    # The run at 10-01 01:00 is for 09-30: due; the one for 10-04 fires at 10-05 01:00.
    days = ["2026-09-30", "2026-10-01", "2026-10-02", "2026-10-03"]
    assert before == {"edges_offset.work": set(days)}
    at = planning.due_keys(dag, first, pendulum.datetime(2026, 10, 5, 1, tz=AMSTERDAM))
    assert at["edges_offset.work"] == {*days, "2026-10-04"}


def test_a_weekday_partition_schedule_is_due_on_its_ticks() -> None:
    """'0 1 * * 2-6' with run_offset=-1 (Tuesday to Saturday): each run is for the tick
    before it, so Tuesday's run is for Saturday; Sunday and Monday are never due."""
    dag = partitioned_dag("edges_weekdays", "0 1 * * 2-6", period="day")
    due = planning.due_keys(
        dag,
        pendulum.datetime(2026, 10, 5, tz=AMSTERDAM),  # a Monday
        pendulum.datetime(2026, 10, 13, 12, tz=AMSTERDAM),  # the Tuesday after next, noon
    )
    # Ticks Tue 10-06 .. Sat 10-10 and Tue 10-13: partitions Sat 10-03, Tue .. Fri, Sat 10-10.
    assert due["edges_weekdays.work"] == {
        "2026-10-03", "2026-10-06", "2026-10-07", "2026-10-08", "2026-10-09", "2026-10-10",
    }  # fmt: skip


def test_gaps_of_an_hourly_job_over_a_window_of_days(pg_dsn: str) -> None:
    """The watch checks a window of days: an hourly partitioned job's due hours in it are
    checked (the 25 hours of the autumn day, one missing), not skipped as 'not days'."""
    dag = partitioned_dag("edges_watch", "0 * * * *")
    due = planning.due_keys(
        dag,
        pendulum.datetime(2026, 10, 24, 22, tz="UTC"),
        pendulum.datetime(2026, 10, 26, tz=AMSTERDAM),
    )["edges_watch.work"]
    day = {k for k in due if "2026-10-24T22Z" <= k <= "2026-10-25T22Z"}
    assert len(day) == 25  # Amsterdam's 25-hour day, in UTC hours
    for key in sorted(day - {"2026-10-25T01Z"}):
        record(pg_dsn, "edges_watch.work", key)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        found = find_gaps(
            conn, "idempotency", "edges_watch.work", "2026-10-25", "2026-10-25", due=due
        )
    assert [(g.run_key, g.kind) for g in found] == [("2026-10-25T01Z", "missing")]


@pytest.mark.usefixtures("airflow_home")
def test_the_watch_follows_when_a_partitions_run_fires(
    airflow_pg_conn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """watch_problems over part_daily (run_offset=-1) at 10-08 00:30: the partition of 10-07
    is not due (its run fires at 01:00), so only the missing 10-03 is a problem."""
    from airflow_idempotency.watch import watch_problems

    monkeypatch.setenv("AIRFLOW__CORE__DAGS_FOLDER", str(TESTS / "dags_partitions"))
    for day in range(1, 7):
        if day != 3:
            record(airflow_pg_conn, "part_daily.work", f"2026-10-0{day}")
    problems = watch_problems(
        ["part_daily"],
        ["part_daily.work"],
        dt.date(2026, 10, 1),
        dt.date(2026, 10, 7),
        as_of=pendulum.datetime(2026, 10, 8, 0, 30, tz="UTC"),
    )
    assert problems == ["part_daily.work 2026-10-03: missing"]


AUTUMN_DAG = """
import pendulum
from airflow.sdk import DAG, CronPartitionTimetable
from airflow_idempotency import IdempotentRunOperator, RunKeyRule

with DAG(
    "meter_hourly",
    schedule=CronPartitionTimetable("0 * * * *", timezone="Europe/Amsterdam", run_offset=-1),
    start_date=pendulum.datetime(2025, 1, 1, tz="Europe/Amsterdam"),
):
    IdempotentRunOperator(
        task_id="work", python_callable=lambda run: None, run_key_rule=RunKeyRule(period="hour")
    )
"""


def test_explain_and_plan_name_the_autumn_hours_by_their_instant(
    airflow_home: Path, pg_dsn: str, tmp_path: Path
) -> None:
    """From the command line: `plan` shows each partition's instant beside its key (the two
    02:00 hours share the key), and `explain --partition-date` takes that instant: one key
    per hour; the key alone is refused naming both, the instant alone is refused too."""
    folder = tmp_path / "dags"
    folder.mkdir()
    (folder / "meter_hourly.py").write_text(AUTUMN_DAG)
    planned = airflow_cli(
        airflow_home, pg_dsn, folder, "plan", "meter_hourly", "--from", "2026-10-25T01:00Z",
        "--to", "2026-10-25T02:00Z",
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-3000:]
    out = planned.stdout
    assert out.index("partition_key") < out.index("partition_date") < out.index("task_id"), out
    assert "2026-10-25T00:00:00+00:00" in out and "2026-10-25T01:00:00+00:00" in out, out

    def explain(*extra: str) -> subprocess.CompletedProcess[str]:
        return airflow_cli(
            airflow_home, pg_dsn, folder, "explain", "meter_hourly", "--run-type", "backfill",
            *extra, "--json",
        )  # fmt: skip

    for instant, key in (
        ("2026-10-25T00:00:00Z", "2026-10-25T00Z"),
        ("2026-10-25T01:00Z", "2026-10-25T01Z"),
    ):
        found = explain("--partition-key", "2026-10-25T02:00:00", "--partition-date", instant)
        assert found.returncode == 0, found.stderr[-3000:]
        assert [row["run_key"] for row in json.loads(found.stdout)] == [key]
    alone = explain("--partition-key", "2026-10-25T02:00:00")
    assert alone.returncode == 2 and "'2026-10-25T00Z'" in alone.stdout, alone.stdout
    instant_only = explain("--partition-date", "2026-10-25T00:00:00Z")
    assert instant_only.returncode == 2 and "give --partition-key too" in instant_only.stderr
