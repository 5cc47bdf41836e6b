"""The zone rule (issue 31, item 2): the zone a run key was made in is recorded, and a DAG
whose timezone changed is refused, naming both zones and what to do, never a silent shift
(real PostgreSQL; the operator through dag.test on the installed Airflow)."""

from __future__ import annotations

from typing import Any

import pendulum
import psycopg
import pytest

from airflow_idempotency import IdempotentRunOperator, RunKeyRule, idempotency_params
from airflow_idempotency.exceptions import ConfigurationError, InvalidInputError
from airflow_idempotency.records import Trigger
from airflow_idempotency.runner import run_idempotently
from support.dag_runs import FAILED, SUCCESS, run_dag


def rows(dsn: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql).fetchall()


def run(dsn: str, key: str, zone: str | None, job: str = "zoned") -> None:
    run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=job,
        run_key=key,
        work=lambda ctx: None,
        trigger=Trigger(triggered_by="manual", key_zone=zone),
    )


def test_a_key_made_in_another_zone_is_refused_and_nothing_is_written(
    pg_dsn: str, lock_mode: str
) -> None:
    """Keys made in Europe/Amsterdam, then one made in UTC: refused naming both zones, the
    latest key and the three ways on; no attempt, no job_runs row (nor a lease). The same
    zone, and keys of no zone (hours, labels), go on. In both lock modes (each decides the
    zone in its own call: run_decide, run_decide_lease)."""
    run(pg_dsn, "2026-10-01", "Europe/Amsterdam")
    run(pg_dsn, "2026-10-02", "Europe/Amsterdam")
    before = rows(pg_dsn, "SELECT count(*) FROM idempotency.job_run_attempts")
    with pytest.raises(ConfigurationError) as refused:
        run(pg_dsn, "2026-10-03", "UTC")
    message = str(refused.value)
    for part in ("UTC", "Europe/Amsterdam", "'2026-10-02'", "2 earlier key(s)", "set it back",
                 "RunKeyRule(..., timezone='Europe/Amsterdam')", "new job_name"):  # fmt: skip
        assert part in message, message
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.job_run_attempts") == before
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]
    assert rows(pg_dsn, "SELECT run_key, key_zone FROM idempotency.job_runs ORDER BY 1") == [
        ("2026-10-01", "Europe/Amsterdam"),
        ("2026-10-02", "Europe/Amsterdam"),
    ]
    with pytest.raises(ConfigurationError):  # a completed key too: its no-op would be a lie
        run(pg_dsn, "2026-10-01", "UTC")
    run(pg_dsn, "2026-10-03", "Europe/Amsterdam")
    run(pg_dsn, "2026-10-03T01Z", None)
    run(pg_dsn, "2026-10-03", "UTC", job="another job")


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("UTC", "Etc/UTC"),  # tz="Etc/UTC" in the DAG file instead of "UTC"
        ("UTC", "+00:00"),  # a start_date with pendulum.FixedTimezone(0)
        ("Etc/GMT", "UTC"),
        ("Europe/Kiev", "Europe/Kyiv"),  # tzdata's rename: one zone, two names
        ("US/Pacific", "America/Los_Angeles"),
    ],
)
def test_one_zone_spelled_another_way_is_no_zone_change(
    pg_dsn: str, before: str, after: str, lock_mode: str
) -> None:
    """The zone rule refuses a key whose period would move. A DAG whose zone is written
    another way (a link of tzdata, a fixed offset of zero for UTC) names the same periods:
    refusing it stalled the job for nothing (adversary, issue 31). Another zone is still
    refused."""
    run(pg_dsn, "2026-10-01", before)
    run(pg_dsn, "2026-10-02", after)
    run(pg_dsn, "2026-10-03", before)
    with pytest.raises(ConfigurationError, match="Europe/Amsterdam"):
        run(pg_dsn, "2026-10-04", "Europe/Amsterdam")


@pytest.mark.usefixtures("airflow_home")
@pytest.mark.both_airflow_lines
def test_a_dag_whose_timezone_changed_is_refused_until_its_zone_is_pinned(
    airflow_pg_conn: str,
) -> None:
    """A DAG in Europe/Amsterdam runs 2026-10-01; the same DAG moved to UTC is refused for
    2026-10-02 (the task fails, no retry, nothing recorded); pinned with
    RunKeyRule(timezone='Europe/Amsterdam') it runs, and its key is recorded in that zone."""
    from airflow.providers.common.compat.sdk import DAG

    calls: list[str] = []

    def dag_in(zone: str, rule: RunKeyRule | None = None) -> Any:
        with DAG(
            "zone_moved",
            schedule=None,
            start_date=pendulum.datetime(2026, 1, 1, tz=zone),
            params=idempotency_params(),
            default_args={"retries": 2},
        ) as dag:
            IdempotentRunOperator(
                task_id="work",
                python_callable=lambda ctx: calls.append(ctx.run_key),
                run_key_rule=rule,
            )
        return dag

    amsterdam = dag_in("Europe/Amsterdam")
    assert run_dag(amsterdam, conf={"run_key": "2026-10-01"}).state == SUCCESS
    moved = run_dag(dag_in("UTC"), conf={"run_key": "2026-10-02"})
    assert moved.state == FAILED and moved.get_task_instances()[0].try_number == 1
    assert calls == ["2026-10-01"]
    pinned = dag_in("UTC", RunKeyRule(timezone="Europe/Amsterdam"))
    assert run_dag(pinned, conf={"run_key": "2026-10-02"}).state == SUCCESS
    assert calls == ["2026-10-01", "2026-10-02"]
    assert rows(
        airflow_pg_conn,
        "SELECT run_key, key_zone FROM idempotency.job_runs WHERE job_name = 'zone_moved.work' "
        "ORDER BY 1",
    ) == [("2026-10-01", "Europe/Amsterdam"), ("2026-10-02", "Europe/Amsterdam")]


def test_the_resolved_key_names_its_zone() -> None:
    """Day keys carry the DAG's zone (or the rule's, or a partitioned DAG's timetable's);
    hour keys and keys of a callable carry none; an unknown zone is refused."""
    from airflow_idempotency.partitions import PartitionSpec
    from airflow_idempotency.run_key import RunFacts, resolve_run_key

    now = pendulum.datetime(2026, 11, 29, tz="UTC")
    facts = RunFacts(run_type="manual", timezone="Asia/Tokyo", now=now, conf_run_key="2026-10-01")
    assert resolve_run_key(RunKeyRule(), facts).zone == "Asia/Tokyo"
    assert resolve_run_key(RunKeyRule(timezone="UTC"), facts).zone == "UTC"
    hour = RunFacts(
        run_type="manual", timezone="Asia/Tokyo", now=now, conf_run_key="2026-10-01T01Z"
    )
    assert resolve_run_key(RunKeyRule(period="hour"), hour).zone is None
    assert resolve_run_key(lambda context: "batch-1", facts).zone is None
    partition = RunFacts(
        run_type="scheduled",
        timezone="UTC",
        now=now,
        partition_key="2026-10-01T00:30:00",
        partition_spec=PartitionSpec(timezone="Europe/Amsterdam"),
    )
    got = resolve_run_key(RunKeyRule(), partition)
    assert (got.run_key, got.zone) == ("2026-10-01", "Europe/Amsterdam")
    with pytest.raises(InvalidInputError, match="Mars/Olympus"):
        RunKeyRule(timezone="Mars/Olympus")
