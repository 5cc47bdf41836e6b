"""Adversary of the cluster policy's repeat paths (issue 34): Airflow's retries, and a retry
of a forced run, through a real DagBag, Airflow's dag.test() (which retries a task whose
retry_delay has passed) and a real job database, on both lines.

Found:
- xfail: a retry of a forced run (conf force=true) whose forced recompute had completed (the
  try failed in Airflow after the work: here post_execute, in production a worker lost
  between the completion and Airflow's success) recomputes again: every try of the forced
  run does the work, because force is read from the run's conf on every try
  (``test_a_retry_of_a_forced_run_does_not_recompute_again``). The docs do not say what a
  retry or a Clear of a forced run does.

Held: a task failing its first try (retries=2) is retried under its one key, the failed
attempt then the completed one, and the work of the date is not done again by a rerun
(``test_a_task_failing_its_first_try_is_retried_under_one_key``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pendulum
import pytest

from support.dag_runs import SUCCESS, load_dag_bag, run_dag, scheduled_logical_date, task_states
from support.db import rows

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]

DAG_HEADER = """
import datetime as dt
import os
import pendulum
from airflow.providers.common.compat.sdk import DAG, task, BaseOperator

def note(line):
    with open(os.environ["POLICY_WORK_LOG"], "a", encoding="utf-8") as log:
        log.write(line + "\\n")

def tries():
    with open(os.environ["POLICY_WORK_LOG"], encoding="utf-8") as log:
        return len(log.read().splitlines())

nightly = DAG("adv_retry", schedule="0 1 * * *", catchup=False, tags=["nightly"],
              start_date=pendulum.datetime(2026, 9, 1, tz="UTC"),
              default_args={"retries": 2, "retry_delay": dt.timedelta(seconds=0)})
"""


def _fire(business_date: str) -> Any:
    return pendulum.parse(scheduled_logical_date(business_date))


@pytest.fixture
def work_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "work.log"
    path.touch()
    monkeypatch.setenv("POLICY_WORK_LOG", str(path))
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", "nightly")
    return path


def _inline_dag(tmp_path: Path, body: str) -> Any:
    folder = tmp_path / "dags"
    folder.mkdir(exist_ok=True)
    (folder / "adv_retry.py").write_text(DAG_HEADER + textwrap.dedent(body))
    bag = load_dag_bag(folder)
    assert not bag.import_errors, bag.import_errors
    return bag.dags["adv_retry"]


def test_a_task_failing_its_first_try_is_retried_under_one_key(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    dag = _inline_dag(
        tmp_path,
        """
        with nightly:
            @task
            def load():
                note("load")
                if tries() == 1:
                    raise RuntimeError("first try fails")
            load()
        """,
    )
    date = _fire("2026-10-01")
    run = run_dag(dag, date)
    assert run.state == SUCCESS, task_states(run)
    assert work_log.read_text().splitlines() == ["load", "load"]
    records = "SELECT job_name, run_key, status, attempt_count FROM idempotency.job_runs"
    assert rows(airflow_pg_conn, records) == [("adv_retry.load", "2026-10-01", "completed", 2)]
    attempts = "SELECT outcome, try_number, run_id FROM idempotency.job_run_attempts"
    assert rows(airflow_pg_conn, f"{attempts} ORDER BY attempt_id") == [
        ("failed", 1, run.run_id),
        ("completed", 2, run.run_id),
    ]
    again = run_dag(dag, date)
    assert again.state == SUCCESS, task_states(again)
    assert work_log.read_text().splitlines() == ["load", "load"]


@pytest.mark.xfail(
    strict=True,
    reason="force is read from the run's conf on every try: a retry of a forced run recomputes "
    "a key its own earlier try completed (fix: a forced attempt no-ops when the key's "
    "completion came from the same task instance and clear of this DAG run)",
)
def test_a_retry_of_a_forced_run_does_not_recompute_again(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The date done, then forced: the forced try recomputes and completes, then fails in
    Airflow (post_execute); its retry must not do the work a third time."""
    dag = _inline_dag(
        tmp_path,
        """
        class Load(BaseOperator):
            def execute(self, context):
                note("load")

            def post_execute(self, context, result=None):
                if os.environ.get("ADV_FAIL_AFTER") and tries() == 2:
                    raise RuntimeError("lost after the work")

        with nightly:
            Load(task_id="load")
        """,
    )
    date = _fire("2026-10-02")
    assert run_dag(dag, date).state == SUCCESS
    monkeypatch.setenv("ADV_FAIL_AFTER", "1")
    forced = run_dag(dag, date, conf={"force": True})
    assert forced.state == SUCCESS, task_states(forced)
    attempts = "SELECT outcome, try_number FROM idempotency.job_run_attempts WHERE run_id = %s"
    outcomes = rows(airflow_pg_conn, f"{attempts} ORDER BY attempt_id", (forced.run_id,))
    assert outcomes[0] == ("completed", 1)  # the forced recompute, then the retry
    assert work_log.read_text().splitlines() == ["load", "load"], outcomes
