"""The cluster policy (docs/policy.md) through a real DagBag and Airflow's dag.test(), on
both lines: a DAG written without the provider, put under the contract by its tag."""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pendulum
import pytest

from support import TESTS
from support.dag_runs import (
    FAILED,
    SUCCESS,
    load_dag_bag,
    run_dag,
    scheduled_logical_date,
    task_states,
)
from support.db import rows

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]


def _fire(business_date: str) -> Any:
    """The logical date of the scheduled run of ``business_date`` (0 1 * * *), this line's."""
    return pendulum.parse(scheduled_logical_date(business_date))


POLICY_DAGS = TESTS / "dags_policy"


@pytest.fixture
def work_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "work.log"
    path.touch()
    monkeypatch.setenv("POLICY_WORK_LOG", str(path))
    return path


@pytest.fixture
def tagged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", "finance, nightly")


def _dag(tmp_path: Path, name: str = "nightly_sales.py") -> Any:
    folder = tmp_path / "dags"
    folder.mkdir(exist_ok=True)
    shutil.copy(POLICY_DAGS / name, folder / name)
    bag = load_dag_bag(folder)
    assert not bag.import_errors, bag.import_errors
    return bag.dags["nightly_sales"]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


@pytest.mark.usefixtures("tagged")
def test_a_tagged_dag_runs_its_work_once_per_date(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """Run twice for one date: extract and load work once, their XCom replayed on the no-op
    run (load reads extract's return value); the exempt task runs both times; force reruns;
    a dry run executes nothing and leaves the records alone."""
    dag = _dag(tmp_path)
    date = _fire("2026-10-01")
    for _ in range(2):
        run = run_dag(dag, date)
        assert run.state == SUCCESS, task_states(run)
    ds = date.date().isoformat()
    assert sorted(_lines(work_log)) == [
        f"extract {ds}",
        f"load {ds}",
        f"notify {ds}",
        f"notify {ds}",
    ]
    records = rows(
        airflow_pg_conn,
        "SELECT job_name, run_key, status, dag_id, task_id, attempt_count, key_zone"
        " FROM idempotency.job_runs ORDER BY job_name",
    )
    assert records == [  # key_zone: the zone the day was read in (the zone rule)
        ("nightly_sales.extract", "2026-10-01", "completed", "nightly_sales", "extract", 1, "UTC"),
        ("nightly_sales.load", "2026-10-01", "completed", "nightly_sales", "load", 1, "UTC"),
    ]
    outcomes = rows(
        airflow_pg_conn,
        "SELECT job_name, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id",
    )
    assert [o for j, o in outcomes if j == "nightly_sales.extract"] == ["completed", "noop"]

    work_log.write_text("")
    assert run_dag(dag, date, conf={"dry_run": True}).state == SUCCESS
    assert _lines(work_log) == [f"notify {ds}"]
    assert run_dag(dag, date, conf={"force": True}).state == SUCCESS
    assert sorted(_lines(work_log)) == [
        f"extract {ds}",
        f"load {ds}",
        f"notify {ds}",
        f"notify {ds}",
    ]


def test_without_the_setting_the_policy_changes_nothing(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No policy_dag_tags (or none of the DAG's tags): plain Airflow, the work every run."""
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", "other")
    dag = _dag(tmp_path)
    assert not any(getattr(type(t), "_idempotency_policy", False) for t in dag.tasks)
    date = _fire("2026-10-02")
    for _ in range(2):
        assert run_dag(dag, date).state == SUCCESS
    assert len(_lines(work_log)) == 6
    assert rows(airflow_pg_conn, "SELECT to_regclass('idempotency.job_runs')") == [(None,)]


REFUSED = {
    "schedule=None": ("schedule=None", "have no business date"),
    "hourly": ('schedule="0 * * * *"', "fires more than once a day"),
    "twice a day": ('schedule="0 1,13 * * *"', "fires more than once a day"),
    "every 6 hours": ("schedule=dt.timedelta(hours=6)", "more than once a day"),
}


@pytest.mark.usefixtures("tagged")
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_tagged_dag_without_a_daily_key_is_refused_at_parse_time(
    case: str, tmp_path: Path
) -> None:
    """The DAG file fails to import, naming the tag, the reason and what to do."""
    schedule, reason = REFUSED[case]
    (tmp_path / "refused.py").write_text(
        textwrap.dedent(
            f"""
            import datetime as dt
            import pendulum
            from airflow.providers.common.compat.sdk import DAG, task

            with DAG("refused", {schedule}, start_date=pendulum.datetime(2026, 9, 1),
                     tags=["finance"]):
                @task
                def work():
                    pass
                work()
            """
        )
    )
    bag = load_dag_bag(tmp_path)
    assert "refused" not in bag.dags
    (error,) = bag.import_errors.values()
    assert "'refused'" in error and "['finance']" in error and reason in error, error
    assert "remove the tag" in error


@pytest.mark.usefixtures("tagged")
def test_daily_schedules_are_taken(tmp_path: Path) -> None:
    """Cron once a day (either line's timetable) and a one-day timedelta are keyed."""
    for schedule in ('"0 1 * * *"', '"@daily"', "dt.timedelta(days=1)", '"30 2 * * 1-5"'):
        (tmp_path / "ok.py").write_text(
            "import datetime as dt\nimport pendulum\n"
            "from airflow.providers.common.compat.sdk import DAG\n"
            f"DAG('ok', schedule={schedule}, start_date=pendulum.datetime(2026, 9, 1),"
            " tags=['nightly'])\n"
        )
        bag = load_dag_bag(tmp_path)
        assert not bag.import_errors, (schedule, bag.import_errors)


DAG_HEADER = """
import os
import pendulum
from airflow.providers.common.compat.sdk import DAG, task, task_group
from airflow_idempotency import notify_once

def note(line):
    with open(os.environ["POLICY_WORK_LOG"], "a", encoding="utf-8") as log:
        log.write(line + "\\n")

nightly = DAG("nightly_sales", schedule="0 1 * * *", catchup=False, tags=["nightly"],
              start_date=pendulum.datetime(2026, 9, 1, tz="UTC"))
"""


def _inline_dag(tmp_path: Path, body: str) -> Any:
    folder = tmp_path / "dags"
    folder.mkdir(exist_ok=True)
    (folder / "nightly_sales.py").write_text(DAG_HEADER + textwrap.dedent(body))
    bag = load_dag_bag(folder)
    assert not bag.import_errors, bag.import_errors
    return bag.dags["nightly_sales"]


@pytest.mark.usefixtures("tagged")
def test_a_dry_run_of_a_policy_task_notifies_nothing(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """notify_once on a task the policy covers: a dry run (the task not executed) sends no
    success notification; the real run sends it, and its no-op rerun does not again."""
    dag = _inline_dag(
        tmp_path,
        """
        with nightly:
            @task(on_success_callback=notify_once(lambda context: note("notified"),
                                                  event="success", name="note"))
            def load():
                note("load")
            load()
        """,
    )
    date = _fire("2026-10-04")
    assert run_dag(dag, date, conf={"dry_run": True}).state == SUCCESS
    assert _lines(work_log) == []
    for _ in range(2):
        assert run_dag(dag, date).state == SUCCESS
    assert _lines(work_log) == ["load", "notified"]


@pytest.mark.usefixtures("tagged")
def test_a_policy_task_in_a_mapped_task_group_is_refused_when_it_runs(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """Its instances would share the day's key (the first working, the others no-ops): each
    fails without doing its work, naming the task, its map index and the way out."""
    dag = _inline_dag(
        tmp_path,
        """
        with nightly:
            @task_group
            def per_region(region):
                @task
                def load(region):
                    note(f"load {region}")
                load(region)
            per_region.expand(region=["eu", "us"])
        """,
    )
    run = run_dag(dag, _fire("2026-10-05"))
    assert run.state == FAILED, task_states(run)
    assert _lines(work_log) == []
    # Refused before it connects: nothing recorded, not even the schema.
    assert rows(airflow_pg_conn, "SELECT to_regclass('idempotency.job_runs')") == [(None,)]


@pytest.mark.usefixtures("tagged")
def test_a_policy_task_and_what_it_starts_read_the_run_key_from_the_environment(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """While a task under the policy executes, AIRFLOW_IDEMPOTENCY_RUN_KEY and
    AIRFLOW_IDEMPOTENCY_JOB hold its day and job, for it and the processes it starts (dbt
    through cosmos: docs/dbt.md); they are gone after it, and an exempt task has none."""
    dag = _inline_dag(
        tmp_path,
        """
        import subprocess, sys

        with nightly:
            @task
            def load():
                code = "import os; print(os.environ['AIRFLOW_IDEMPOTENCY_RUN_KEY'], os.environ['AIRFLOW_IDEMPOTENCY_JOB'])"
                note(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                    text=True, check=True).stdout.strip())

            @task(params={"idempotency_exempt": True})
            def notify():
                note(f"notify {os.environ.get('AIRFLOW_IDEMPOTENCY_RUN_KEY')}")

            load() >> notify()
        """,
    )
    assert run_dag(dag, _fire("2026-10-06")).state == SUCCESS
    assert _lines(work_log) == ["2026-10-06 nightly_sales.load", "notify None"]
    assert "AIRFLOW_IDEMPOTENCY_RUN_KEY" not in os.environ
