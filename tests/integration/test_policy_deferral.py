"""A deferrable operator under the cluster policy (issue 34, docs/policy.md, deferrable
operators), through a real DagBag, Airflow's dag.test() (which runs the trigger inline) and a
real job database, on both lines.

The deferral ends the attempt ``deferred`` (the run stays started, the lock is released);
Airflow's resumption (``resume_execution``) is a new attempt of the key: a no-op once the key
is completed, else the resumed method is the work. Here: two deferrals; a resumed method
that fails (the key failed, a rerun does the task again); a trigger's failure (``__fail__``)
recorded failed; another execution that completed the key while the task was deferred (the
resumption is a no-op), or that holds it when the task resumes (the resumed try fails as
``lock_held`` and completes nothing). The single deferral and its rerun:
test_policy_adversary.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pendulum
import psycopg
import pytest

from support.dag_runs import (
    FAILED,
    SUCCESS,
    load_dag_bag,
    run_dag,
    scheduled_logical_date,
    task_states,
)
from support.db import rows
from support.locks import Background, wait_for

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]

JOB = "deferring.submit"
ATTEMPTS = "SELECT outcome FROM idempotency.job_run_attempts ORDER BY attempt_id"

DAG_HEADER = """
import datetime as dt
import os
import pendulum
from airflow.providers.common.compat.sdk import DAG, BaseOperator
try:
    from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
except ImportError:  # Airflow 2.11: core's
    from airflow.triggers.temporal import TimeDeltaTrigger

def note(line):
    with open(os.environ["POLICY_WORK_LOG"], "a", encoding="utf-8") as log:
        log.write(line + "\\n")

def wait(seconds=0):
    return TimeDeltaTrigger(dt.timedelta(seconds=seconds))

dag = DAG("deferring", schedule="0 1 * * *", catchup=False, tags=["nightly"],
          start_date=pendulum.datetime(2026, 9, 1, tz="UTC"))
"""


@pytest.fixture(autouse=True)
def tagged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", "nightly")


@pytest.fixture
def work_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "work.log"
    path.touch()
    monkeypatch.setenv("POLICY_WORK_LOG", str(path))
    return path


def _dag(tmp_path: Path, operator: str) -> Any:
    folder = tmp_path / "dags"
    folder.mkdir(exist_ok=True)
    body = textwrap.dedent(operator) + '\nwith dag:\n    Submit(task_id="submit")\n'
    (folder / "deferring.py").write_text(DAG_HEADER + body)
    bag = load_dag_bag(folder)
    assert not bag.import_errors, bag.import_errors
    return bag.dags["deferring"]


def _fire(business_date: str) -> Any:
    return pendulum.parse(scheduled_logical_date(business_date))


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _status(dsn: str) -> list[tuple[Any, ...]]:
    return rows(dsn, "SELECT status FROM idempotency.job_runs")


def test_a_task_deferring_twice_completes_its_key_once(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """Each deferral ends an attempt ``deferred``; the last resumption completes the key; the
    rerun of the date is a no-op (no part runs again)."""
    dag = _dag(
        tmp_path,
        """
        class Submit(BaseOperator):
            def execute(self, context):
                note("submit")
                self.defer(trigger=wait(), method_name="middle")

            def middle(self, context, event=None):
                note("middle")
                self.defer(trigger=wait(), method_name="done")

            def done(self, context, event=None):
                note("done")
                return {"rows": 3}
        """,
    )
    for _ in range(2):
        run = run_dag(dag, _fire("2026-10-05"))
        assert run.state == SUCCESS, task_states(run)
    assert _lines(work_log) == ["submit", "middle", "done"]
    assert _status(airflow_pg_conn) == [("completed",)]
    assert rows(airflow_pg_conn, ATTEMPTS) == [
        ("deferred",),
        ("deferred",),
        ("completed",),
        ("noop",),
    ]
    # what the resumed method returned is kept for the no-op's replay, as execute's is
    assert rows(airflow_pg_conn, "SELECT details FROM idempotency.job_runs") == [
        ({"return_value": {"rows": 3}},)
    ]


def test_a_resumed_method_that_fails_fails_the_key_and_a_rerun_does_the_task(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resumption's failure is the key's (failed, not completed); the rerun of the date
    runs the task again from execute (the key failed) and completes it."""
    flag = tmp_path / "fail-once"
    flag.touch()
    monkeypatch.setenv("POLICY_FAIL_ONCE", str(flag))
    dag = _dag(
        tmp_path,
        """
        class Submit(BaseOperator):
            def execute(self, context):
                note("submit")
                self.defer(trigger=wait(), method_name="done")

            def done(self, context, event=None):
                if os.path.exists(os.environ["POLICY_FAIL_ONCE"]):
                    os.remove(os.environ["POLICY_FAIL_ONCE"])
                    note("done failed")
                    raise RuntimeError("the resumed part failed")
                note("done")
        """,
    )
    run = run_dag(dag, _fire("2026-10-06"))
    assert run.state == FAILED, task_states(run)
    assert _status(airflow_pg_conn) == [("failed",)]
    assert rows(airflow_pg_conn, ATTEMPTS) == [("deferred",), ("failed",)]
    run = run_dag(dag, _fire("2026-10-06"))
    assert run.state == SUCCESS, task_states(run)
    assert _lines(work_log) == ["submit", "done failed", "submit", "done"]
    assert _status(airflow_pg_conn) == [("completed",)]
    assert rows(airflow_pg_conn, ATTEMPTS) == [
        ("deferred",),
        ("failed",),
        ("deferred",),
        ("completed",),
    ]


def test_a_trigger_failure_is_recorded_failed_not_completed(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """A trigger's failure comes back as ``next_method="__fail__"``: Airflow's own
    resume_execution raises TaskDeferralError, inside the contract: the key is failed."""
    dag = _dag(
        tmp_path,
        """
        class Submit(BaseOperator):
            def execute(self, context):
                note("submit")
                # what the triggerer hands back when a trigger fails: __fail__ and its error
                self.defer(trigger=wait(), method_name="__fail__",
                           kwargs={"error": "the trigger failed"})
        """,
    )
    run = run_dag(dag, _fire("2026-10-07"))
    assert run.state == FAILED, task_states(run)
    assert _lines(work_log) == ["submit"]
    assert _status(airflow_pg_conn) == [("failed",)]
    (outcomes, errors) = zip(
        *rows(
            airflow_pg_conn,
            "SELECT outcome, error FROM idempotency.job_run_attempts ORDER BY attempt_id",
        ),
        strict=True,
    )
    assert outcomes == ("deferred", "failed")
    assert "TaskDeferralError" in errors[1], errors


def _other_execution(dsn: str, work_log: Path, hold_until_refused: bool) -> Background:
    """Another execution of the key (a second DAG run of the date, here the contract itself)
    that starts once the task's attempt is deferred (its lock released) and completes the
    key; with ``hold_until_refused`` its work waits until the resumption was refused."""
    from airflow_idempotency.records import Trigger
    from airflow_idempotency.runner import run_idempotently

    def recorded(outcome: str) -> bool:
        sql = "SELECT 1 FROM idempotency.job_run_attempts WHERE outcome = %(outcome)s"
        try:
            return bool(rows(dsn, sql, {"outcome": outcome}))
        except psycopg.errors.UndefinedTable:  # the task's first run has not made it yet
            return False

    def work(ctx: Any) -> dict[str, Any]:
        with work_log.open("a", encoding="utf-8") as log:
            log.write("other\n")
        if hold_until_refused:
            wait_for("the resumption refused", lambda: recorded("lock_held"), timeout=60)
        return {}

    def call() -> Any:
        wait_for("the task's attempt deferred", lambda: recorded("deferred"), timeout=60)
        return run_idempotently(
            connect=lambda: psycopg.connect(dsn),
            job_name=JOB,
            run_key="2026-10-08",
            work=work,
            trigger=Trigger(triggered_by="manual", key_zone="UTC"),
        )

    return Background(call)


SLOW_DEFERRAL = """
class Submit(BaseOperator):
    def execute(self, context):
        note("submit")
        self.defer(trigger=wait(4), method_name="done")

    def done(self, context, event=None):
        note("done")
"""


def test_a_key_completed_while_the_task_was_deferred_makes_its_resumption_a_noop(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """The lock is released while the task waits for its trigger: another execution may
    take the key and complete it. The resumption then does nothing (a no-op): it never
    completes a key another attempt completed, nor does the resumed part for it again."""
    dag = _dag(tmp_path, SLOW_DEFERRAL)
    other = _other_execution(airflow_pg_conn, work_log, hold_until_refused=False)
    run = run_dag(dag, _fire("2026-10-08"))
    other.join(timeout=60)
    assert other.error is None, other.error
    assert run.state == SUCCESS, task_states(run)
    assert _lines(work_log) == ["submit", "other"]
    assert _status(airflow_pg_conn) == [("completed",)]
    assert rows(airflow_pg_conn, ATTEMPTS) == [("deferred",), ("completed",), ("noop",)]


def test_a_key_held_elsewhere_when_the_task_resumes_fails_the_try_as_lock_held(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """Another execution holds the key when the task resumes: the resumption records
    ``lock_held`` and fails this try (it does not wait: a resumed task cannot be rescheduled
    back into its trigger); the other execution completes the key, and the rerun of the date
    is a no-op."""
    dag = _dag(tmp_path, SLOW_DEFERRAL)
    other = _other_execution(airflow_pg_conn, work_log, hold_until_refused=True)
    run = run_dag(dag, _fire("2026-10-08"))
    other.join(timeout=90)
    assert other.error is None, other.error
    assert run.state == FAILED, task_states(run)
    assert rows(airflow_pg_conn, ATTEMPTS) == [("deferred",), ("completed",), ("lock_held",)]
    run = run_dag(dag, _fire("2026-10-08"))
    assert run.state == SUCCESS, task_states(run)
    assert _lines(work_log) == ["submit", "other"]
    assert _status(airflow_pg_conn) == [("completed",)]


def test_an_idempotent_run_operator_whose_run_defers_completes_its_key_once(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """IdempotentRunOperator had the same defect (the policy leaves it alone): a subclass
    whose ``run`` defers was recorded failed and resumed outside the contract. Its deferral
    ends the attempt ``deferred``, the resumed method is the next attempt's work (it returns
    the counts, as ``run`` does), and the rerun of the date is a no-op."""
    dag = _dag(
        tmp_path,
        """
        from airflow_idempotency import IdempotentRunOperator

        class Submit(IdempotentRunOperator):
            def run(self, ctx):
                note("submit")
                self.defer(trigger=wait(), method_name="done")

            def done(self, context, event=None):
                note("done")
                return {"rows": 2}
        """,
    )
    for _ in range(2):
        run = run_dag(dag, _fire("2026-10-09"))
        assert run.state == SUCCESS, task_states(run)
    assert _lines(work_log) == ["submit", "done"]
    assert _status(airflow_pg_conn) == [("completed",)]
    assert rows(airflow_pg_conn, ATTEMPTS) == [("deferred",), ("completed",), ("noop",)]


def test_a_task_resumed_into_execute_itself_runs_it_once_under_its_attempt(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """A deferral may name ``execute`` itself (``method_name="execute"``): the resumption
    calls the original execute as the new attempt's work, not a second contract inside it
    (which would find its own key locked)."""
    dag = _dag(
        tmp_path,
        """
        class Submit(BaseOperator):
            def execute(self, context, event=None):
                if event is None:
                    note("submit")
                    self.defer(trigger=wait(), method_name="execute")
                note("done")
        """,
    )
    for _ in range(2):
        run = run_dag(dag, _fire("2026-10-10"))
        assert run.state == SUCCESS, task_states(run)
    assert _lines(work_log) == ["submit", "done"]
    assert rows(airflow_pg_conn, ATTEMPTS) == [("deferred",), ("completed",), ("noop",)]
