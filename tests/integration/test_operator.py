"""IdempotentRunOperator through Airflow's real dag.test() code path, against real Postgres."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pendulum
import psycopg
import pytest
from airflow.providers.common.compat.sdk import DAG, task
from airflow.timetables.trigger import CronTriggerTimetable

from airflow_idempotency import IdempotentRunOperator, RunContext, RunKeyRule, idempotency_params
from support.dag_runs import (
    FAILED,
    SUCCESS,
    airflow3_only,
    daily_dag,
    run_dag,
    task_states,
    utc,
)
from support.db import rows

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]


def make_dag(
    dag_id: str, work: Callable[[RunContext], Any], *, form: bool = True, **op_kwargs: Any
) -> DAG:
    """A daily DAG of one idempotent task; ``form`` adds the trigger-form params."""
    with daily_dag(dag_id, params=idempotency_params() if form else None) as dag:
        IdempotentRunOperator(task_id="work", python_callable=work, **op_kwargs)
    return dag


def test_completed_key_twice_runs_the_work_once(airflow_pg_conn: str) -> None:
    """The same date run twice through dag.test: work runs once, the second run succeeds as a recorded no-op."""
    calls: list[str] = []

    def work(run: RunContext) -> dict[str, int]:
        calls.append(run.run_key)
        return {"orders_seen": 7}

    dag = make_dag("op_twice", work)
    first = run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    second = run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    assert (first.state, second.state) == (SUCCESS, SUCCESS)
    assert calls == ["2026-10-01"]
    assert rows(
        airflow_pg_conn,
        "SELECT job_name, run_key, status, triggered_by, details FROM idempotency.job_runs",
    ) == [("op_twice.work", "2026-10-01", "completed", "manual", {"orders_seen": 7})]
    assert rows(
        airflow_pg_conn,
        "SELECT outcome, dag_id, task_id, try_number FROM idempotency.job_run_attempts ORDER BY attempt_id",
    ) == [("completed", "op_twice", "work", 1), ("noop", "op_twice", "work", 1)]


def test_explicit_run_key_in_conf_wins(airflow_pg_conn: str) -> None:
    """A manual run with conf run_key processes that date, whatever its logical date."""
    seen: list[str] = []
    dag = make_dag("op_conf_key", lambda run: seen.append(run.run_key))
    dr = run_dag(dag, logical_date=utc(2026, 10, 20, 1), conf={"run_key": "2026-09-30"})
    assert dr.state == SUCCESS and seen == ["2026-09-30"]


def test_failure_then_rerun_completes(airflow_pg_conn: str, tmp_path: Path) -> None:
    """A failing task leaves the key failed; the rerun of the same date completes it."""
    flag = tmp_path / "fail"
    flag.touch()

    def work(run: RunContext) -> None:
        if flag.exists():
            raise RuntimeError("upstream file missing")

    dag = make_dag("op_fail", work)
    assert run_dag(dag, logical_date=utc(2026, 10, 2, 1)).state == FAILED
    assert rows(airflow_pg_conn, "SELECT status FROM idempotency.job_runs") == [("failed",)]
    flag.unlink()
    assert run_dag(dag, logical_date=utc(2026, 10, 2, 1)).state == SUCCESS
    assert rows(airflow_pg_conn, "SELECT status, attempt_count FROM idempotency.job_runs") == [
        ("completed", 2)
    ]


def test_force_and_dry_run_from_conf(airflow_pg_conn: str) -> None:
    """force in conf reruns a completed key; dry_run in conf writes nothing and records a dry_run attempt."""
    with psycopg.connect(airflow_pg_conn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.facts (run_key text, n int)")

    def work(run: RunContext) -> dict[str, int]:
        with run.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES (%s, 1)", (run.run_key,))
        return {"inserted": 1}

    dag = make_dag("op_force", work)
    conf = {"run_key": "2026-10-01"}
    run_dag(dag, logical_date=None, conf=conf)
    run_dag(dag, logical_date=None, conf={**conf, "dry_run": True, "force": True})
    assert rows(airflow_pg_conn, "SELECT count(*) FROM public.facts") == [(1,)]
    # dag.test runs tasks in this process, where the DAG object keeps the params of the
    # previous run: say dry_run=False explicitly (a real worker parses the DAG afresh).
    run_dag(dag, logical_date=None, conf={**conf, "force": True, "dry_run": False})
    assert rows(airflow_pg_conn, "SELECT count(*) FROM public.facts") == [(2,)]
    assert rows(
        airflow_pg_conn,
        "SELECT outcome, force, dry_run FROM idempotency.job_run_attempts ORDER BY attempt_id",
    ) == [("completed", False, False), ("dry_run", True, True), ("completed", True, False)]


@airflow3_only
def test_manual_run_without_date_or_key_fails_and_writes_nothing(airflow_pg_conn: str) -> None:
    """No logical date and no run_key: the task fails without retry, naming run_key; nothing is written."""
    calls: list[int] = []
    dag = make_dag("op_nodate", lambda run: calls.append(1), retries=3)
    dr = run_dag(dag, logical_date=None)
    assert dr.state == FAILED and calls == []
    ti = dr.get_task_instances()[0]
    assert ti.try_number == 1  # AirflowFailException: the retries were not used
    assert rows(
        airflow_pg_conn, "SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'"
    ) == [(0,)]


@pytest.mark.parametrize(
    "bad_key", ["2026-13-01", "yesterday", "2026-10-01'); DELETE FROM job_runs; --"]
)
def test_malformed_conf_run_key_fails_and_writes_nothing(
    airflow_pg_conn: str, bad_key: str
) -> None:
    """A malformed run_key in conf (DAG without the form params) fails the task, writing nothing."""
    dag = make_dag("op_badkey", lambda run: None, form=False)
    assert run_dag(dag, logical_date=None, conf={"run_key": bad_key}).state == FAILED
    assert rows(
        airflow_pg_conn, "SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'"
    ) == [(0,)]


def test_trigger_form_params_refuse_bad_input_up_front(airflow_pg_conn: str) -> None:
    """With idempotency_params(), Airflow itself refuses a malformed run_key or flag at trigger time."""
    from airflow.exceptions import ParamValidationError

    # Airflow 3.2's dag.test re-raises the refusal as "ValueError: Invalid input for param".
    refused = (ParamValidationError, ValueError)
    dag = make_dag("op_form", lambda run: None)
    with pytest.raises(refused, match="run_key"):
        run_dag(dag, logical_date=None, conf={"run_key": "2026-13-01"})
    with pytest.raises(refused, match="force"):
        run_dag(dag, logical_date=None, conf={"run_key": "2026-10-01", "force": "yes please"})
    assert rows(
        airflow_pg_conn, "SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'"
    ) == [(0,)]


def test_open_period_refused_then_allowed(airflow_pg_conn: str) -> None:
    """A logical date of 'now' (the UI's pre-fill) with offset 0 is refused unless the author allows it."""
    now = pendulum.now("UTC")
    refused = make_dag("op_open", lambda run: None, run_key_rule=RunKeyRule(offset=0))
    assert run_dag(refused, logical_date=now).state == FAILED
    allowed = make_dag(
        "op_open_ok", lambda run: None, run_key_rule=RunKeyRule(offset=0, allow_open_period=True)
    )
    assert run_dag(allowed, logical_date=now).state == SUCCESS


def test_bad_flag_in_conf_is_refused(airflow_pg_conn: str) -> None:
    """force must be a boolean: 'yes please' is refused before anything is written."""
    dag = make_dag("op_badflag", lambda run: None, form=False)
    assert (
        run_dag(dag, logical_date=utc(2026, 10, 2, 1), conf={"force": "yes please"}).state == FAILED
    )
    assert rows(
        airflow_pg_conn, "SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'"
    ) == [(0,)]


def test_unknown_connection_fails_clearly(airflow_pg_conn: str) -> None:
    """An undefined postgres_conn_id fails the task (no retry) and names the connection."""
    dag = make_dag("op_noconn", lambda run: None, postgres_conn_id="no_such_conn", retries=2)
    dr = run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    assert dr.state == FAILED and dr.get_task_instances()[0].try_number == 1


def test_amsterdam_dag_keys_by_local_date_across_dst(airflow_pg_conn: str) -> None:
    """A DAG in Europe/Amsterdam firing at 00:30 local gets the previous local day on both DST changes."""
    seen: list[str] = []
    with DAG(
        "op_amsterdam",
        schedule=CronTriggerTimetable("30 0 * * *", timezone="Europe/Amsterdam"),
        catchup=False,
        start_date=pendulum.datetime(2026, 1, 1, tz="Europe/Amsterdam"),
    ) as dag:
        IdempotentRunOperator(task_id="work", python_callable=lambda run: seen.append(run.run_key))
    for fire in ("2026-03-29T00:30", "2026-03-30T00:30", "2026-10-25T00:30", "2026-10-26T00:30"):
        local = pendulum.parse(fire, tz="Europe/Amsterdam")
        assert isinstance(local, pendulum.DateTime)
        assert run_dag(dag, logical_date=local.in_timezone("UTC")).state == SUCCESS
    assert seen == ["2026-03-28", "2026-03-29", "2026-10-24", "2026-10-25"]


def test_subclass_overriding_run(airflow_pg_conn: str) -> None:
    """A subclass that overrides run() gets the same contract."""
    calls: list[str] = []

    class LoadOperator(IdempotentRunOperator):
        def run(self, ctx: RunContext) -> dict[str, int]:
            calls.append(ctx.run_key)
            return {"loaded": 1}

    with daily_dag("op_subclass") as dag:
        LoadOperator(task_id="load")
    run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    assert calls == ["2026-10-01"]


def test_taskflow_decorator(airflow_pg_conn: str) -> None:
    """@task.idempotent_run passes the run context first and the DAG's arguments after it."""
    calls: list[tuple[str, int]] = []
    with daily_dag("op_decorator") as dag:

        @task.idempotent_run(job_name="decorated job")
        def load(run: RunContext, batch: int) -> dict[str, int]:
            calls.append((run.run_key, batch))
            return {"batch": batch}

        load(batch=5)  # type: ignore[call-arg, misc]  # the operator passes the RunContext
    run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    assert calls == [("2026-10-01", 5)]
    assert rows(airflow_pg_conn, "SELECT job_name, details FROM idempotency.job_runs") == [
        ("decorated job", {"batch": 5})
    ]


def test_a_templated_key_segment_is_rendered_in_both_forms(airflow_pg_conn: str) -> None:
    """key_segment is templated (the docs say so, and the parse-time check leaves a templated
    one for run time) in the operator and in @task.idempotent_run alike: the key is
    ``eu|2026-10-01``, never the template's own text ``{{ params.region }}|2026-10-01``."""
    with daily_dag("op_segment_template", params={"region": "eu"}) as dag:

        @task.idempotent_run(key_segment="{{ params.region }}")
        def decorated(run: RunContext) -> None:
            pass

        decorated()  # type: ignore[call-arg, misc]
        IdempotentRunOperator(
            task_id="classic", python_callable=lambda run: None, key_segment="{{ params.region }}"
        )
    assert run_dag(dag, logical_date=utc(2026, 10, 2)).state == SUCCESS
    assert rows(
        airflow_pg_conn, "SELECT job_name, run_key FROM idempotency.job_runs ORDER BY job_name"
    ) == [
        ("op_segment_template.classic", "eu|2026-10-01"),
        ("op_segment_template.decorated", "eu|2026-10-01"),
    ]


def test_a_mapped_task_without_a_segment_is_refused_not_done_once(airflow_pg_conn: str) -> None:
    """A task mapped over regions with no key_segment gave every instance the same run key:
    the first did its region, every other was a successful no-op, its region never done.
    Each instance is refused instead (nothing runs, nothing is recorded), the message
    naming key_segment; with the segment expanded, each region is done once."""
    calls: list[tuple[str, str]] = []

    def work(run: RunContext, region: str) -> None:
        calls.append((run.run_key, region))

    regions = [{"region": "eu"}, {"region": "us"}]
    with daily_dag("op_mapped_no_segment") as dag:
        IdempotentRunOperator.partial(task_id="work", python_callable=work).expand(
            op_kwargs=regions
        )
    refused = run_dag(dag, logical_date=utc(2026, 10, 2))
    assert refused.state == FAILED and calls == []
    assert rows(airflow_pg_conn, "SELECT to_regclass('idempotency.job_runs')") == [(None,)]
    with daily_dag("op_mapped_segment") as dag:
        IdempotentRunOperator.partial(
            task_id="work", python_callable=work, key_segment="{{ task.op_kwargs.region }}"
        ).expand(op_kwargs=regions)
    assert run_dag(dag, logical_date=utc(2026, 10, 2)).state == SUCCESS
    assert sorted(calls) == [("eu|2026-10-01", "eu"), ("us|2026-10-01", "us")]


def test_return_value_is_the_counts_replayed_on_a_noop(airflow_pg_conn: str) -> None:
    """A TaskFlow consumer receives the dict the work returned, the same one on the no-op
    rerun (replayed from job_runs.details); an empty result and a dry run push nothing."""
    received: list[tuple[str, Any]] = []
    with daily_dag("op_returns", params=idempotency_params()) as dag:

        @task.idempotent_run
        def counted(run: RunContext) -> dict[str, int]:
            return {"invoices": 3}

        @task.idempotent_run
        def silent(run: RunContext) -> None:
            return None

        @task
        def consume(counts: Any, nothing: Any) -> None:
            received.append(("counted", counts))
            received.append(("silent", nothing))

        consume(counted(), silent())  # type: ignore[call-arg, misc]  # the RunContext, as above
    run_dag(dag, logical_date=utc(2026, 10, 2, 1))  # completes both keys
    run_dag(dag, logical_date=utc(2026, 10, 2, 1))  # both no-ops
    # dag.test keeps the previous run's params in this process: say force/dry_run each time.
    run_dag(dag, logical_date=utc(2026, 10, 2, 1), conf={"dry_run": True, "force": True})
    assert received == [
        ("counted", {"invoices": 3}),
        ("silent", None),
        ("counted", {"invoices": 3}),
        ("silent", None),
        ("counted", None),
        ("silent", None),
    ]
    outcomes = rows(
        airflow_pg_conn,
        "SELECT job_name, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id",
    )
    assert sorted(outcomes) == sorted(
        [
            (f"op_returns.{t}", o)
            for t in ("counted", "silent")
            for o in ("completed", "noop", "dry_run")
        ]
    )


def test_on_completed_skip(airflow_pg_conn: str) -> None:
    """With on_completed='skip' the no-op rerun ends skipped instead of success."""
    dag = make_dag("op_skip", lambda run: None, on_completed="skip")
    run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    dr = run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    assert task_states(dr) == {"work": "skipped"}


def test_callable_run_key_rule(airflow_pg_conn: str) -> None:
    """A callable run_key_rule names the key; a manual run's explicit free-text run_key wins."""
    seen: list[str] = []
    dag = make_dag(
        "op_callable",
        lambda run: seen.append(run.run_key),
        form=False,
        run_key_rule=lambda context: "fiscal-" + context["logical_date"].strftime("%Y"),
    )
    run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    run_dag(dag, logical_date=utc(2026, 10, 2, 1), conf={"run_key": "fiscal-2025"})
    assert seen == ["fiscal-2026", "fiscal-2025"]


def test_provider_is_listed_by_airflow(airflow_home: Path) -> None:
    """`airflow providers list` shows the provider, registered through its entry point."""
    out = subprocess.run(
        [sys.executable, "-m", "airflow", "providers", "list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "airflow-provider-idempotency" in out


def test_dag_file_parsing_does_no_io() -> None:
    """Building the operator touches no database (DAG files are parsed often)."""
    op = IdempotentRunOperator(
        task_id="t", python_callable=lambda run: None, postgres_conn_id="nowhere"
    )
    assert op.postgres_conn_id == "nowhere" and "hook" not in op.__dict__
    with pytest.raises(ValueError, match="python_callable"):
        IdempotentRunOperator(task_id="t2")
    assert dt.timedelta(seconds=30) == op.reschedule_interval


def test_the_connections_extra_chooses_the_lease_mode(
    airflow_pg_conn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``"lock_mode": "lease"`` in the job database connection's extra: the operator's runs hold
    their keys as leases (the attempt names its lease, no lock session); a bad value fails the
    task, naming the allowed ones, and writes nothing."""
    import json

    from devtools.airflow_env import airflow_connection_json

    def with_extra(**extra: Any) -> None:
        conn = {**json.loads(airflow_connection_json(airflow_pg_conn)), "extra": extra}
        monkeypatch.setenv("AIRFLOW_CONN_IDEMPOTENCY_DEFAULT", json.dumps(conn))

    with_extra(lock_mode="lease", lease_ttl=10)
    dag = make_dag("op_lease", lambda run: {"n": 1})
    assert run_dag(dag, logical_date=utc(2026, 10, 2, 1)).state == SUCCESS
    assert rows(
        airflow_pg_conn,
        "SELECT outcome, lock_backend_pid, details->>'lease' LIKE 'lease:%%'"
        " FROM idempotency.job_run_attempts",
    ) == [("completed", None, True)]
    with_extra(lock_mode="leases")
    assert (
        run_dag(make_dag("op_bad_mode", lambda run: None), logical_date=utc(2026, 10, 2, 1)).state
        == FAILED
    )
    assert rows(
        airflow_pg_conn, "SELECT count(*) FROM idempotency.job_runs WHERE job_name LIKE 'op_bad%%'"
    ) == [(0,)]
