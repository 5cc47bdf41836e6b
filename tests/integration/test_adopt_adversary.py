"""Adversary of ``adopt`` (issue 34, docs/adopt.md), on real DAG runs and a real job database,
on both lines.

Found:
- a DAG run that succeeded although one of its protected tasks did not (it failed and a
  downstream ``all_done`` leaf succeeded, or the task was added to the DAG after the run):
  adopt recorded that task's key completed, so the work it never did became a no-op for
  good (``test_a_task_that_did_not_succeed_in_a_succeeded_run_is_not_adopted``).
- a dry run (conf ``dry_run``) succeeds without doing the protected tasks' work and leaves
  job_runs unchanged: adopt recorded its keys completed, so the date's real run was a no-op
  and its work never done (``test_a_dry_run_is_not_adopted``; fixed: refused, naming it).
- ``--to 9999-12-31`` crashed with an OverflowError traceback (exit 1) where a usage error
  was due (``test_the_last_representable_day_is_refused_clearly``; fixed: exit 2).

Held (read in the code; tests/integration/test_adopt.py drives them): each key is written in
its own transaction under its run lock (``pg_try_advisory_xact_lock``), only where no record
exists, so a live run's key is left ``locked`` and a re-apply writes nothing; ``--from`` after
``--to`` exits 2 having written nothing.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pendulum
import psycopg
import pytest

from airflow_idempotency import adoption
from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS
from airflow_idempotency.schema import ensure_schema
from support.cli import cli
from support.dag_runs import SUCCESS, load_dag_bag, run_dag, scheduled_logical_date, task_states
from support.db import rows

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]

DAG_ID = "adv_adopt"
DAG_FILE = """
import os
import pendulum
from airflow.providers.common.compat.sdk import DAG, task

with DAG("adv_adopt", schedule="0 1 * * *", catchup=False, tags=["nightly"],
         start_date=pendulum.datetime(2026, 9, 1, tz="UTC")):
    @task(retries=0)
    def extract():
        if os.environ.get("ADV_FAIL_EXTRACT"):
            raise RuntimeError("extract failed")

    @task(trigger_rule="all_done")
    def report():
        pass

    extract() >> report()
"""
LATER_FILE = (
    DAG_FILE
    + """
    @task
    def new_table():
        pass

    new_table()
"""
)


def _fire(business_date: str) -> Any:
    return pendulum.parse(scheduled_logical_date(business_date))


def _dag(folder: Path, source: str) -> Any:
    folder.mkdir(exist_ok=True)
    (folder / f"{DAG_ID}.py").write_text(textwrap.dedent(source))
    bag = load_dag_bag(folder)
    assert not bag.import_errors, bag.import_errors
    return bag.dags[DAG_ID]


def _read(made: list[Any]) -> list[adoption.SucceededRun]:
    """The runs as adopt reads them: Airflow 2's metadata through adoption.metadata_runs;
    on 3.x (whose REST API needs an api-server) as the API gives them, task states included."""
    ours = {r.run_id for r in made}
    if not AIRFLOW_V_3_0_PLUS:
        first = min(r.logical_date for r in made)
        read = adoption.metadata_runs(DAG_ID, first, first + pendulum.duration(days=10))
        return [r for r in read if r.run_id in ours]
    return [
        adoption.SucceededRun(
            run_id=r.run_id,
            run_type=str(getattr(r.run_type, "value", r.run_type)),
            logical_date=r.logical_date,
            end_date=r.end_date,
            conf=dict(r.conf or {}),
            task_states=adoption.task_states(
                (ti.task_id, str(getattr(ti.state, "value", ti.state)))
                for ti in r.get_task_instances()
            ),
        )
        for r in made
    ]


def test_a_task_that_did_not_succeed_in_a_succeeded_run_is_not_adopted(
    airflow_pg_conn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "dags"
    dag = _dag(folder, DAG_FILE)
    monkeypatch.setenv("ADV_FAIL_EXTRACT", "1")
    made = run_dag(dag, _fire("2026-10-01"))
    assert made.state == SUCCESS, task_states(made)  # report (all_done) is the leaf
    assert task_states(made)["extract"] == "failed"
    monkeypatch.delenv("ADV_FAIL_EXTRACT")
    # A task added to the DAG after the run: it has no task instance in the run.
    runs = _read([made])
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", "nightly")
    dag = _dag(folder, LATER_FILE)
    assert sorted(dag.task_ids) == ["extract", "new_table", "report"]
    with psycopg.connect(airflow_pg_conn, autocommit=True) as conn:
        ensure_schema(conn, "idempotency")
        planned = adoption.plan(dag, runs, conn, "idempotency")
        adoption.apply(conn, "idempotency", DAG_ID, planned)
    would = {a.task_id: a.would for a in planned}
    assert would == {"extract": "refused", "new_table": "refused", "report": "adopted"}, planned
    assert rows(airflow_pg_conn, "SELECT job_name FROM idempotency.job_runs") == [
        (f"{DAG_ID}.report",)
    ]


def test_a_dry_run_is_not_adopted(
    airflow_pg_conn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DAG run with ``{"dry_run": true}`` succeeds without doing the work of a protected
    task (the policy does not execute it; the operator rolls it back) and leaves job_runs
    unchanged: adopting it would record the key completed, and the date's real run would
    then be a no-op, its work never done."""
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", "nightly")
    dag = _dag(tmp_path / "dags", DAG_FILE)
    made = run_dag(dag, _fire("2026-10-05"), conf={"dry_run": True})
    assert made.state == SUCCESS, task_states(made)
    assert rows(airflow_pg_conn, "SELECT count(*) FROM idempotency.job_runs") == [(0,)]
    with psycopg.connect(airflow_pg_conn, autocommit=True) as conn:
        planned = adoption.plan(dag, _read([made]), conn, "idempotency")
        adoption.apply(conn, "idempotency", DAG_ID, planned)
    assert {a.would for a in planned} == {"refused"}, planned
    assert all("dry run" in a.reason for a in planned), planned
    assert rows(airflow_pg_conn, "SELECT count(*) FROM idempotency.job_runs") == [(0,)]


@pytest.mark.parametrize("days", [("2026-10-01", "9999-12-31"), ("9999-12-31", "9999-12-31")])
def test_the_last_representable_day_is_refused_clearly(
    days: tuple[str, str],
    airflow_pg_conn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--to 9999-12-31`` (an operator's "everything"): the end of its day is past Python's
    last date; the command crashed with an OverflowError traceback (exit 1, as a failure of
    the database would) instead of naming the option (exit 2, nothing written)."""
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", "nightly")
    folder = tmp_path / "dags"
    _dag(folder, DAG_FILE)
    first, last = days
    code, _, err = cli(
        capsys,
        *("adopt", DAG_ID, "--dsn", airflow_pg_conn, "--dags-folder", str(folder)),
        *("--from", first, "--to", last, "--api-url", "http://127.0.0.1:9", "--apply"),
    )
    assert code == 2 and "--to 9999-12-31" in err and "Traceback" not in err, err
    assert rows(airflow_pg_conn, "SELECT to_regclass('idempotency.job_runs')") == [(None,)]
