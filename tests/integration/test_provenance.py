"""Provenance on every attempt: the Airflow ids a task execution ran under, read from
Airflow's real task context through dag.test() on each line, compared with what Airflow's
own metadata database recorded, and printed by ``show``."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from airflow.providers.common.compat.sdk import task

from airflow_idempotency import IdempotentRunOperator, RunContext
from airflow_idempotency.cli import main
from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS
from support.dag_runs import SUCCESS, daily_dag, run_dag, utc
from support.db import rows

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]

COLUMNS = (
    "task_id, outcome, run_id, try_number, run_type, triggering_user, clear_number, ti_id,"
    " dag_version_id"
)


def provenance_dag(dag_id: str) -> Any:
    """A daily DAG of two idempotent tasks: the operator's (``work``) and the decorator's
    (``load``)."""
    with daily_dag(dag_id) as dag:
        IdempotentRunOperator(task_id="work", python_callable=lambda run: {"n": 1})

        @task.idempotent_run
        def load(run: RunContext) -> dict[str, int]:
            return {"n": 2}

        load()  # type: ignore[call-arg, misc]  # the operator passes the RunContext
    return dag


def airflow_ids(dag_run: Any) -> dict[str, tuple[Any, ...]]:
    """task_id -> what Airflow's metadata database holds of each task instance of ``dag_run``:
    its run id, try number, id and DAG version (Airflow 3; ``None`` on 2.x, whose task
    instances have neither)."""
    return {
        ti.task_id: (
            ti.run_id,
            ti.try_number,
            getattr(ti, "id", None) if AIRFLOW_V_3_0_PLUS else None,
            getattr(ti, "dag_version_id", None) if AIRFLOW_V_3_0_PLUS else None,
        )
        for ti in dag_run.get_task_instances()
    }


def test_every_attempt_records_the_airflow_ids_it_ran_under(airflow_pg_conn: str) -> None:
    """A date run twice (the work, then a no-op), by the operator and by the decorator: each
    attempt row holds its own task instance's id, try, run type, clear number and DAG version
    as Airflow recorded them (3.x), and on 2.11 NULL where Airflow 2 has no such value (no
    task instance id, no DAG version, no triggering user)."""
    dag = provenance_dag("prov_ids")
    first = run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    first_ids = airflow_ids(first)  # dag.test deletes this run when it runs the date again
    second = run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    assert (first.state, second.state) == (SUCCESS, SUCCESS)
    second_ids = airflow_ids(second)
    recorded = rows(
        airflow_pg_conn,
        f"SELECT {COLUMNS} FROM idempotency.job_run_attempts ORDER BY task_id, attempt_id",
    )
    user = "dag_test" if AIRFLOW_V_3_0_PLUS else None  # 3.x dag.test's triggering user
    expected = []
    for task_id in ("load", "work"):
        for outcome, run, ids in (("completed", first, first_ids), ("noop", second, second_ids)):
            run_id, try_number, ti_id, version = ids[task_id]
            assert run_id == run.run_id
            clears = run.clear_number
            row = (task_id, outcome, run_id, try_number, "manual", user, clears, ti_id, version)
            expected.append(row)
    assert recorded == expected
    if AIRFLOW_V_3_0_PLUS:
        ti_ids = [row[7] for row in recorded]
        assert all(isinstance(v, uuid.UUID) for v in ti_ids) and len(set(ti_ids)) == 4
        assert all(isinstance(row[8], uuid.UUID) for row in recorded)
    else:
        assert {(row[7], row[8]) for row in recorded} == {(None, None)}


def test_show_prints_where_each_attempt_came_from(
    airflow_pg_conn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``show`` prints each attempt's provenance as a table and in --json: the run type and
    clear number on both lines, the task instance id and DAG version on 3.x."""
    dag = provenance_dag("prov_show")
    dag_run = run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    assert dag_run.state == SUCCESS
    _, _, ti_id, version = airflow_ids(dag_run)["work"]
    capsys.readouterr()
    argv = ["show", "prov_show.work", "2026-10-01", "--dsn", airflow_pg_conn]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "Airflow provenance of the attempts" in table and "manual" in table
    assert main([*argv, "--json"]) == 0
    (attempt,) = json.loads(capsys.readouterr().out)["attempts"]
    assert (attempt["run_type"], attempt["clear_number"]) == ("manual", 0)
    assert attempt["run_id"] == dag_run.run_id
    if AIRFLOW_V_3_0_PLUS:
        assert (attempt["ti_id"], attempt["dag_version_id"]) == (str(ti_id), str(version))
        assert str(ti_id) in table and str(version) in table  # whole, on one line
    else:
        assert (attempt["ti_id"], attempt["dag_version_id"]) == (None, None)
