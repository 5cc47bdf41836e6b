"""Testing a partitioned DAG locally as docs/partitioned-runs.md says: `airflow dags test`
(dag.test) sets no partition key, so the run is refused, its message saying to give the
period as run_key; with `-c '{"run_key": ...}'` it runs the period, and again is a no-op."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pendulum
import psycopg
import pytest

from airflow_idempotency import IdempotentRunOperator, RunContext, idempotency_params
from airflow_idempotency.compat import AIRFLOW_V_3_2_PLUS
from support.dag_runs import FAILED, SUCCESS, run_dag

pytestmark = pytest.mark.skipif(not AIRFLOW_V_3_2_PLUS, reason="partitioned runs: Airflow 3.2+")


def test_dags_test_of_a_partitioned_dag_takes_the_period_as_run_key(
    airflow_home: Path, airflow_pg_conn: str
) -> None:
    """Without a key: refused (FAILED, nothing run). With run_key in the conf: the period is
    run once, and the second run is a recorded no-op of the same key."""
    from airflow.sdk import DAG, CronPartitionTimetable

    calls: list[str] = []

    def work(run: RunContext) -> dict[str, Any]:
        calls.append(run.run_key)
        return {"done": 1}

    with DAG(
        "partitioned_dags_test",
        schedule=CronPartitionTimetable("0 1 * * *", timezone="UTC", run_offset=-1),
        start_date=pendulum.datetime(2026, 10, 1, tz="UTC"),
        catchup=False,
        params=idempotency_params(),
    ) as dag:
        IdempotentRunOperator(task_id="work", python_callable=work)

    refused = run_dag(dag)
    assert refused.state == FAILED and calls == []
    runs = [run_dag(dag, conf={"run_key": "2026-10-01"}) for _ in range(2)]
    assert [r.state for r in runs] == [SUCCESS, SUCCESS]
    assert calls == ["2026-10-01"]
    with psycopg.connect(airflow_pg_conn) as conn:
        outcomes = conn.execute(
            "SELECT outcome, run_key FROM idempotency.job_run_attempts ORDER BY attempt_id"
        ).fetchall()
    assert outcomes == [("completed", "2026-10-01"), ("noop", "2026-10-01")]
