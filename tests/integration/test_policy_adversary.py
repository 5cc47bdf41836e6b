"""Adversary of the cluster policy (issue 34, docs/policy.md), through a real DagBag, Airflow's
dag.test() and a real job database, on both lines.

Found:
- a task whose return value is JSON that PostgreSQL's jsonb refuses (a float NaN or
  Infinity, a string holding a NUL character) did its work, then failed at the completion
  write: the key was never completed and every retry and rerun did the work again
  (``test_a_return_value_jsonb_refuses_does_not_undo_the_completion``);
- schedules that fire more than once a day were taken: a MultipleCronTriggerTimetable of two
  daily crons and a ``relativedelta(hours=6)`` (``test_more_schedules_firing_twice_a_day_are_refused``);
- a cron string firing twice a day only outside the 40 days the check sampled from January 5
  (``'0 8,20 * 3-5 *'``, ``'0 6,18 31 12 *'``) was taken: those days' second runs no-ops
  (``test_more_schedules_firing_twice_a_day_are_refused``; fixed: the cron's own minute and
  hour fields are read);
- a branching operator was put under the contract: on 2.11 its no-op skipped nothing and the
  branch not taken ran on a rerun of the date; on 3.x its skip (DownstreamTasksSkipped)
  recorded its key failed on every run
  (``test_a_branch_not_taken_stays_skipped_when_the_date_runs_again``);
- a deferring operator's key was recorded failed (TaskDeferred) while Airflow resumed it
  outside the contract: its first part ran again on every rerun
  (``test_a_deferring_task_does_its_work_once_per_date``; more in test_policy_deferral.py).

Held: without the fix, a return value Airflow 3 itself cannot push (NaN, Infinity: httpx's
JSON) fails the task in Airflow, not in the contract. Read in the code, not driven here: a DAG parsed twice
in one process is not wrapped twice (``protected()``, one cached subclass per class); tasks
that are IdempotentRunOperator are left alone; sensors are left alone; a mapped task group's
instances are refused (tests/integration/test_policy.py).
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


def _fire(business_date: str) -> Any:
    return pendulum.parse(scheduled_logical_date(business_date))


@pytest.fixture
def work_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "work.log"
    path.touch()
    monkeypatch.setenv("POLICY_WORK_LOG", str(path))
    return path


@pytest.fixture
def tagged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", "finance, nightly")


DAG_HEADER = """
import os
import pendulum
from airflow.providers.common.compat.sdk import DAG, task

def note(line):
    with open(os.environ["POLICY_WORK_LOG"], "a", encoding="utf-8") as log:
        log.write(line + "\\n")

nightly = DAG("adv_policy", schedule="0 1 * * *", catchup=False, tags=["nightly"],
              start_date=pendulum.datetime(2026, 9, 1, tz="UTC"))
"""


def _inline_dag(tmp_path: Path, body: str, dag_id: str = "adv_policy") -> Any:
    folder = tmp_path / "dags"
    folder.mkdir(exist_ok=True)
    (folder / f"{dag_id}.py").write_text(DAG_HEADER + textwrap.dedent(body))
    bag = load_dag_bag(folder)
    assert not bag.import_errors, bag.import_errors
    return bag.dags[dag_id]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


@pytest.mark.usefixtures("tagged")
@pytest.mark.parametrize(
    "value", ['{"ratio": float("nan")}', 'float("inf")', '"a\\x00b"'], ids=["nan", "inf", "nul"]
)
def test_a_return_value_jsonb_refuses_does_not_undo_the_completion(
    value: str, airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """Python's json.dumps writes NaN, Infinity and \\u0000, which jsonb refuses: the value
    was kept for the no-op's replay, and the completion write failed after the work. The
    work must be done once and the key completed; such a value is not kept (as one too
    large is not)."""
    from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS

    if AIRFLOW_V_3_0_PLUS and "float" in value:
        pytest.skip("Airflow 3 itself refuses to push NaN or Infinity as an XCom (httpx's JSON)")
    dag = _inline_dag(
        tmp_path,
        f"""
        with nightly:
            @task
            def compute():
                note("compute")
                return {value}
            compute()
        """,
    )
    date = _fire("2026-10-01")
    for _ in range(2):
        run = run_dag(dag, date)
        assert run.state == SUCCESS, task_states(run)
    assert _lines(work_log) == ["compute"]
    assert rows(airflow_pg_conn, "SELECT status FROM idempotency.job_runs") == [("completed",)]


REFUSED = {
    "two daily crons": (
        "MultipleCronTriggerTimetable('0 1 * * *', '0 13 * * *', timezone='UTC')",
        "from airflow.timetables.trigger import MultipleCronTriggerTimetable",
    ),
    "relativedelta of 6 hours": (
        "relativedelta(hours=6)",
        "from dateutil.relativedelta import relativedelta",
    ),
    # Twice a day only in months the parse-time check did not sample (its 40 days from
    # January 5): the spring quarter, the year's last day.
    "twice a day in spring": ("'0 8,20 * 3-5 *'", ""),
    "twice on new year's eve": ("'0 6,18 31 12 *'", ""),
}


@pytest.mark.usefixtures("tagged")
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_more_schedules_firing_twice_a_day_are_refused(case: str, tmp_path: Path) -> None:
    """The day's second run would be a no-op: refused at parse time, as a cron string
    firing twice a day is."""
    schedule, imports = REFUSED[case]
    if "Multiple" in imports:
        pytest.importorskip("airflow.timetables.trigger", exc_type=ImportError)
        from airflow.timetables import trigger

        if not hasattr(trigger, "MultipleCronTriggerTimetable"):
            pytest.skip("no MultipleCronTriggerTimetable on this line")
    (tmp_path / "refused.py").write_text(
        f"import pendulum\n{imports}\n"
        "from airflow.providers.common.compat.sdk import DAG\n"
        f"dag = DAG('refused', schedule={schedule}, start_date=pendulum.datetime(2026, 9, 1),"
        " tags=['finance'])\n"
    )
    bag = load_dag_bag(tmp_path)
    assert "refused" not in bag.dags
    (error,) = bag.import_errors.values()
    assert "more than once a day" in error, error


@pytest.mark.usefixtures("tagged")
def test_a_deferring_task_does_its_work_once_per_date(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """A deferrable operator (execute does its first part, then defers; Airflow resumes it in
    another method): under the policy its first part ran again on every rerun of the date,
    because the key was recorded failed (TaskDeferred) while Airflow recorded success. Now the
    deferral ends the attempt ``deferred``, the resumption completes the key, and the rerun of
    the date is a no-op."""
    dag = _inline_dag(
        tmp_path,
        """
        import datetime as dt
        from airflow.providers.common.compat.sdk import BaseOperator
        try:
            from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
        except ImportError:  # Airflow 2.11: core's
            from airflow.triggers.temporal import TimeDeltaTrigger

        class Submit(BaseOperator):
            def execute(self, context):
                note("submit")
                self.defer(trigger=TimeDeltaTrigger(dt.timedelta(seconds=0)),
                           method_name="done")

            def done(self, context, event=None):
                note("done")

        with nightly:
            Submit(task_id="submit")
        """,
    )
    date = _fire("2026-10-03")
    for _ in range(2):
        run = run_dag(dag, date)
        assert run.state == SUCCESS, task_states(run)
    assert _lines(work_log) == ["submit", "done"]
    assert rows(airflow_pg_conn, "SELECT status FROM idempotency.job_runs") == [("completed",)]
    assert rows(
        airflow_pg_conn, "SELECT outcome FROM idempotency.job_run_attempts ORDER BY attempt_id"
    ) == [("deferred",), ("completed",), ("noop",)]


@pytest.mark.usefixtures("tagged")
def test_a_branch_not_taken_stays_skipped_when_the_date_runs_again(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """A branching operator decides which tasks run by skipping the others, inside its
    execute: a no-op of it (its key completed) skips nothing, and the branch not taken ran
    on the rerun of the date (its own key had no record: its work done for the first time,
    against the branch's decision)."""
    dag = _inline_dag(
        tmp_path,
        """
        with nightly:
            @task.branch
            def choose():
                return "taken"

            @task
            def taken():
                note("taken")

            @task
            def not_taken():
                note("not_taken")

            choose() >> [taken(), not_taken()]
        """,
    )
    date = _fire("2026-10-04")
    for _ in range(2):
        run = run_dag(dag, date)
        assert run.state == SUCCESS, task_states(run)
        assert task_states(run)["not_taken"] == "skipped", task_states(run)
    assert _lines(work_log) == ["taken"]
    # Every task succeeded in Airflow: no key is recorded failed (Airflow 3's skip is an
    # exception, DownstreamTasksSkipped, that the contract took for the work's failure).
    assert rows(airflow_pg_conn, "SELECT job_name, status FROM idempotency.job_runs") == [
        ("adv_policy.taken", "completed")
    ]
