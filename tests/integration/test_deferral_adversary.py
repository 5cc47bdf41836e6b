"""An adversary's pass over deferral under the contract (docs/policy.md, deferrable
operators), through real Airflow (dag.test runs the trigger inline) and a real job database,
on both lines: a forced rerun whose task defers, a dry run of an IdempotentRunOperator whose
``run`` defers, and a deferral in the lease mode (the connection's extra).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pendulum
import pytest

from devtools import airflow_env
from support.dag_runs import SUCCESS, load_dag_bag, run_dag, scheduled_logical_date, task_states
from support.db import rows

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]

ATTEMPTS = "SELECT outcome, force, dry_run FROM idempotency.job_run_attempts ORDER BY attempt_id"

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

POLICY_SUBMIT = """
class Submit(BaseOperator):
    def execute(self, context):
        note("submit")
        self.defer(trigger=wait(), method_name="done")

    def done(self, context, event=None):
        note("done")
        return {"rows": 3}
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


def test_a_forced_rerun_that_defers_recomputes_once_and_the_next_run_is_a_noop(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """A completed day rerun with force=true: its deferral ends a forced attempt, its
    resumption is forced too (the key is started again, not completed by anyone else) and
    completes it once; the next plain run of the day is a no-op."""
    dag = _dag(tmp_path, POLICY_SUBMIT)
    for conf in (None, {"force": True}, None):
        run = run_dag(dag, _fire("2026-10-12"), conf=conf)
        assert run.state == SUCCESS, task_states(run)
    assert _lines(work_log) == ["submit", "done", "submit", "done"]
    assert rows(airflow_pg_conn, ATTEMPTS) == [
        ("deferred", False, False),
        ("completed", False, False),
        ("deferred", True, False),
        ("completed", True, False),
        ("noop", False, False),
    ]
    assert rows(airflow_pg_conn, "SELECT status FROM idempotency.job_runs") == [("completed",)]


def test_a_dry_run_whose_run_defers_leaves_no_write_and_completes_nothing(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """IdempotentRunOperator in a dry run: ``run`` writes through the run's transaction and
    defers, the resumed method returns counts. Nothing written before the deferral stays, the
    key is not recorded (a dry run leaves job_runs alone), both attempts are dry; the real
    run afterwards does the whole task."""
    with_table = "CREATE TABLE IF NOT EXISTS public.loaded (day text)"
    rows(airflow_pg_conn, with_table)
    dag = _dag(
        tmp_path,
        """
        from airflow_idempotency import IdempotentRunOperator

        class Submit(IdempotentRunOperator):
            def run(self, ctx):
                note("submit")
                with ctx.transaction() as cur:
                    cur.execute("INSERT INTO public.loaded VALUES (%s)", (ctx.run_key,))
                self.defer(trigger=wait(), method_name="done")

            def done(self, context, event=None):
                note("done")
                return {"rows": 1}
        """,
    )
    run = run_dag(dag, _fire("2026-10-13"), conf={"dry_run": True})
    assert run.state == SUCCESS, task_states(run)
    assert rows(airflow_pg_conn, "SELECT day FROM public.loaded") == []
    assert rows(airflow_pg_conn, "SELECT status FROM idempotency.job_runs") == []
    assert rows(airflow_pg_conn, ATTEMPTS) == [("deferred", False, True), ("dry_run", False, True)]
    run = run_dag(dag, _fire("2026-10-13"))
    assert run.state == SUCCESS, task_states(run)
    assert _lines(work_log) == ["submit", "done", "submit", "done"]
    assert rows(airflow_pg_conn, "SELECT day FROM public.loaded") == [("2026-10-13",)]
    assert rows(airflow_pg_conn, "SELECT status FROM idempotency.job_runs") == [("completed",)]


def test_a_deferral_in_the_lease_mode_completes_the_key_once(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection's extra says lock_mode lease: the deferral ends the attempt, the lease
    is released (no lease left live), the resumption completes the key, the rerun is a
    no-op."""
    env = airflow_env.connection_env(airflow_pg_conn)
    conn = json.loads(env["AIRFLOW_CONN_IDEMPOTENCY_DEFAULT"])
    conn["extra"] = {**(conn.get("extra") or {}), "lock_mode": "lease", "lease_ttl": 20}
    monkeypatch.setenv("AIRFLOW_CONN_IDEMPOTENCY_DEFAULT", json.dumps(conn))
    dag = _dag(tmp_path, POLICY_SUBMIT)
    for _ in range(2):
        run = run_dag(dag, _fire("2026-10-14"))
        assert run.state == SUCCESS, task_states(run)
    assert _lines(work_log) == ["submit", "done"]
    assert [r[0] for r in rows(airflow_pg_conn, ATTEMPTS)] == ["deferred", "completed", "noop"]
    details = rows(
        airflow_pg_conn,
        "SELECT details ? 'lease' FROM idempotency.job_run_attempts ORDER BY attempt_id",
    )
    assert details[:2] == [(True,), (True,)], details  # both attempts held the key by lease


def test_a_mapped_operator_over_segments_defers_and_completes_each_segment_once(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """IdempotentRunOperator mapped over segments, each instance's ``run`` defers: each
    resumption is a new attempt of its own segment's key (the key re-resolved from the
    resumed instance: its map index, its templated segment), never another segment's; the
    rerun of the day is a no-op for both."""
    folder = tmp_path / "dags"
    folder.mkdir()
    body = textwrap.dedent(
        """
        from airflow_idempotency import IdempotentRunOperator

        class Submit(IdempotentRunOperator):
            def run(self, ctx):
                note("submit " + ctx.run_key)
                self.defer(trigger=wait(), method_name="done")

            def done(self, context, event=None):
                # (dag.test hands the resumption the trigger's event alone, not defer's kwargs)
                note(f"done {context['ti'].map_index}")
                return {"map_index": context["ti"].map_index}

        with dag:
            Submit.partial(task_id="submit").expand(key_segment=["eu", "us"])
        """
    )
    (folder / "deferring.py").write_text(DAG_HEADER + body)
    bag = load_dag_bag(folder)
    assert not bag.import_errors, bag.import_errors
    dag = bag.dags["deferring"]
    for _ in range(2):
        run = run_dag(dag, _fire("2026-10-15"))
        assert run.state == SUCCESS, task_states(run)
    assert sorted(_lines(work_log)) == [
        "done 0",
        "done 1",
        "submit eu|2026-10-15",
        "submit us|2026-10-15",
    ]
    by_key = rows(
        airflow_pg_conn,
        "SELECT run_key, array_agg(outcome ORDER BY attempt_id), "
        "array_agg(map_index ORDER BY attempt_id) "
        "FROM idempotency.job_run_attempts GROUP BY run_key ORDER BY run_key",
    )
    assert by_key == [
        ("eu|2026-10-15", ["deferred", "completed", "noop"], [0, 0, 0]),
        ("us|2026-10-15", ["deferred", "completed", "noop"], [1, 1, 1]),
    ]
    assert rows(
        airflow_pg_conn, "SELECT run_key, details FROM idempotency.job_runs ORDER BY run_key"
    ) == [
        ("eu|2026-10-15", {"map_index": 0}),
        ("us|2026-10-15", {"map_index": 1}),
    ]


def test_a_run_that_defers_inside_its_transaction_never_completes_without_its_writes(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path
) -> None:
    """``self.defer()`` inside ``run.transaction()``: Airflow's TaskDeferred leaves the block
    as an exception, so the block's writes roll back. The resumption must not then complete
    the key as if the part before the deferral had landed (data never processed, and a rerun
    is a no-op): the try fails, naming the misuse, and the key is failed."""
    rows(airflow_pg_conn, "CREATE TABLE IF NOT EXISTS public.loaded (day text)")
    dag = _dag(
        tmp_path,
        """
        from airflow_idempotency import IdempotentRunOperator

        class Submit(IdempotentRunOperator):
            def run(self, ctx):
                note("submit")
                with ctx.transaction() as cur:
                    cur.execute("INSERT INTO public.loaded VALUES (%s)", (ctx.run_key,))
                    self.defer(trigger=wait(), method_name="done")

            def done(self, context, event=None):
                note("done")
                return {"rows": 1}
        """,
    )
    run_dag(dag, _fire("2026-10-16"))
    loaded = rows(airflow_pg_conn, "SELECT day FROM public.loaded")
    status = rows(airflow_pg_conn, "SELECT status FROM idempotency.job_runs")
    assert loaded == [] and status == [("failed",)], (loaded, status)
    assert _lines(work_log) == ["submit"]
    ((outcome, error),) = rows(
        airflow_pg_conn, "SELECT outcome, error FROM idempotency.job_run_attempts"
    )
    assert outcome == "failed" and "inside run.transaction()" in error, error
