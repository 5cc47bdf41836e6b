"""dbt through astronomer-cosmos under the contract, with real dbt on real PostgreSQL
(docs/dbt.md).

The project tests/dbt_project (orders_daily: an incremental model, append strategy, one
business day per run; customer_totals: a table built from it) rendered by cosmos as
tests/dags_dbt/dbt_shop.py, a DAG that does not import the provider: its tag puts every
model's task under the contract through the cluster policy, one key per model and day. What
dbt really committed is counted by the project's own witness, a row per model built in
``analytics.dbt_builds`` (written inside each model's transaction).

In a tests/stack file because one step SIGKILLs an ``airflow dags test`` process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pendulum
import pytest
from psycopg.conninfo import conninfo_to_dict

from devtools.postgres import PostgresServer, temporary_database
from devtools.workers import kill_group
from support import TESTS
from support.dag_runs import SUCCESS, load_dag_bag, run_dag, scheduled_logical_date, task_states
from support.db import rows
from support.workers import start_worker

pytestmark = [pytest.mark.usefixtures("airflow_home")]

ROOT = TESTS.parent
DBT_DAGS = TESTS / "dags_dbt"
DBT_PROJECT = TESTS / "dbt_project"
PRE_HOOK = """    pre_hook="{{ replace_run_key_rows('order_date') }}",\n"""
MODELS = ("orders_daily", "customer_totals")
# Business days 10-01 (5 orders) and 10-02 (3 orders), and a day with no run.
ORDERS = [(i, i % 3, 10 * i, "2026-10-01") for i in range(1, 6)]
ORDERS += [(i, i % 3, 10 * i, "2026-10-02") for i in range(6, 9)]
ORDERS += [(9, 0, 90, "2026-10-03")]


def _dbt_executable() -> str | None:
    configured = os.environ.get("IDEMPOTENCY_DBT_EXECUTABLE")
    candidate = Path(configured) if configured else ROOT / ".venv-dbt" / "bin" / "dbt"
    return str(candidate) if candidate.exists() else None


@pytest.fixture(scope="module")
def dbt_executable() -> str:
    """dbt's executable in its own environment (dev.py setup makes .venv-dbt/), and cosmos
    in Airflow's; missing either skips the module (fails it in CI, which installs both)."""
    missing = []
    try:
        import cosmos  # noqa: F401
    except ImportError:
        missing.append("astronomer-cosmos in Airflow's environment")
    executable = _dbt_executable()
    if executable is None:
        missing.append("dbt (IDEMPOTENCY_DBT_EXECUTABLE, or .venv-dbt/bin/dbt)")
    if missing:
        reason = f"needs {' and '.join(missing)}: `python3 dev.py setup` installs both"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    assert executable is not None
    return executable


@pytest.fixture
def shop_dsn(pg_server: PostgresServer) -> Iterator[str]:
    """A database of its own (dbt_ prefix): the job database and dbt's target, with the
    source table shop.raw_orders filled."""
    with temporary_database(pg_server, "dbt_shop") as dsn:
        rows(
            dsn,
            "CREATE SCHEMA shop; CREATE TABLE shop.raw_orders (order_id int PRIMARY KEY,"
            " customer_id int NOT NULL, amount numeric NOT NULL, order_date date NOT NULL)",
        )
        for order in ORDERS:
            rows(dsn, "INSERT INTO shop.raw_orders VALUES (%s, %s, %s, %s)", order)
        yield dsn


def _connection(dsn: str) -> str:
    """The dbt target as an Airflow connection; cosmos's profile mapping requires a password
    (a trust-authenticated server ignores it)."""
    params = conninfo_to_dict(dsn)
    conn = {
        "conn_type": "postgres",
        "host": params.get("host", "127.0.0.1"),
        "port": int(str(params.get("port") or 5432)),
        "login": params.get("user", "postgres"),
        "password": params.get("password") or "unused-by-trust-auth",
        "schema": params["dbname"],
    }
    return json.dumps(conn)


@pytest.fixture
def shop_env(shop_dsn: str, dbt_executable: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {
        "AIRFLOW_CONN_IDEMPOTENCY_DEFAULT": _connection(shop_dsn),
        "AIRFLOW_CONN_DBT_SHOP": _connection(shop_dsn),
        "AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS": "nightly",
        "IDEMPOTENCY_DBT_EXECUTABLE": dbt_executable,
        # cosmos reports each run of a cosmos DAG to its vendor unless told not to.
        "AIRFLOW__COSMOS__ENABLE_TELEMETRY": "False",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def _dbt_without_the_pre_hook(executable: str, dsn: str, folder: Path, day: str) -> None:
    """``dbt run`` of orders_daily for ``day`` with its pre-hook removed (a plain append),
    outside Airflow: the broken build the test must catch."""
    project = folder / "project"
    shutil.copytree(DBT_PROJECT, project, ignore=shutil.ignore_patterns("target", "logs"))
    model = project / "models" / "orders_daily.sql"
    text = model.read_text()
    assert PRE_HOOK in text
    model.write_text(text.replace(PRE_HOOK, ""))
    params = conninfo_to_dict(dsn)
    target = {
        "type": "postgres",
        "host": params.get("host", "127.0.0.1"),
        "port": int(str(params.get("port") or 5432)),
        "user": params.get("user", "postgres"),
        "password": params.get("password") or "",
        "dbname": params["dbname"],
        "schema": "analytics",
        "threads": 1,
    }
    profile = {"idempotency_shop": {"target": "witness", "outputs": {"witness": target}}}
    (folder / "profiles.yml").write_text(json.dumps(profile))  # JSON is YAML
    proc = subprocess.run(
        [executable, "run", "--select", "orders_daily", "--project-dir", str(project),
         "--profiles-dir", str(folder)],
        env={**os.environ, "AIRFLOW_IDEMPOTENCY_RUN_KEY": day}, cwd=folder,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]


def _builds(dsn: str) -> Counter[tuple[str, str]]:
    """How many times dbt committed each (model, day)."""
    return Counter(rows(dsn, "SELECT model, run_key FROM analytics.dbt_builds"))


def _orders_per_day(dsn: str) -> dict[str, tuple[int, int]]:
    """orders_daily's rows and distinct orders, per day."""
    found = rows(
        dsn,
        "SELECT order_date::text, count(*), count(DISTINCT order_id) FROM analytics.orders_daily"
        " GROUP BY 1 ORDER BY 1",
    )
    return {day: (n, distinct) for day, n, distinct in found}


def _totals(dsn: str) -> list[tuple[Any, ...]]:
    return rows(dsn, "SELECT customer_id, orders, amount FROM analytics.customer_totals ORDER BY 1")


def _fire(day: str) -> Any:
    return pendulum.parse(scheduled_logical_date(day))


def _run(dag: Any, day: str, **conf: Any) -> float:
    started = time.monotonic()
    run = run_dag(dag, _fire(day), conf=conf or None)
    assert run.state == SUCCESS, task_states(run)
    return time.monotonic() - started


def test_dbt_models_under_the_contract_build_once_per_day_without_duplicates(
    shop_env: dict[str, str],
    shop_dsn: str,
    dbt_executable: str,
    airflow_home: Path,
    tmp_path: Path,
) -> None:
    """Day D twice: the models are built once (the second run is a no-op, rows unchanged);
    a run SIGKILLed after dbt committed orders_daily, before its completion was recorded,
    then retried: the day's rows once; force rebuilds without duplicates; a second day is
    appended once. The witness: the model without its pre-hook doubles a day built again."""
    bag = load_dag_bag(DBT_DAGS)
    assert not bag.import_errors, bag.import_errors
    dag = bag.dags["dbt_shop"]
    assert {t.task_id for t in dag.tasks} == {f"{m}.{s}" for m in MODELS for s in ("run", "test")}

    first = _run(dag, "2026-10-01")
    assert _builds(shop_dsn) == {(m, "2026-10-01"): 1 for m in MODELS}
    assert _orders_per_day(shop_dsn) == {"2026-10-01": (5, 5)}
    totals = _totals(shop_dsn)

    again = _run(dag, "2026-10-01")
    assert _builds(shop_dsn) == {(m, "2026-10-01"): 1 for m in MODELS}  # nothing built
    assert _orders_per_day(shop_dsn) == {"2026-10-01": (5, 5)}
    assert _totals(shop_dsn) == totals
    outcomes = rows(
        shop_dsn,
        "SELECT job_name, array_agg(outcome ORDER BY attempt_id) FROM idempotency.job_run_attempts"
        " WHERE run_key = '2026-10-01' GROUP BY 1 ORDER BY 1",
    )
    assert outcomes == [
        (f"dbt_shop.{m}.{s}", ["completed", "noop"])
        for m in sorted(MODELS)
        for s in ("run", "test")
    ]

    started = time.monotonic()
    # Day 10-02, in another process SIGKILLed right after dbt committed orders_daily (its
    # first model) and before the contract recorded it completed.
    worker = start_worker(
        airflow_home, "dbt_shop", scheduled_logical_date("2026-10-02"), shop_dsn,
        env={**shop_env, "AIRFLOW_IDEMPOTENCY_CRASH_AT": "runner.before_completion@1"},
        dags_folder=DBT_DAGS,
    )  # fmt: skip
    try:
        output, _ = worker.communicate(timeout=300)
    finally:
        kill_group(worker)
    crashed = time.monotonic() - started
    assert worker.returncode == -9, output[-3000:]
    assert _builds(shop_dsn)[("orders_daily", "2026-10-02")] == 1  # dbt committed
    assert rows(
        shop_dsn,
        "SELECT status FROM idempotency.job_runs"
        " WHERE job_name = 'dbt_shop.orders_daily.run' AND run_key = '2026-10-02'",
    ) != [("completed",)]

    retry = _run(dag, "2026-10-02")  # dbt appends the day again: its rows replaced, not doubled
    assert _builds(shop_dsn)[("orders_daily", "2026-10-02")] == 2
    assert _orders_per_day(shop_dsn) == {"2026-10-01": (5, 5), "2026-10-02": (3, 3)}

    forced = _run(dag, "2026-10-01", force=True)
    assert _builds(shop_dsn)[("orders_daily", "2026-10-01")] == 2
    assert _orders_per_day(shop_dsn) == {"2026-10-01": (5, 5), "2026-10-02": (3, 3)}
    amounts = {c: (n, a) for c, n, a in _totals(shop_dsn)}
    assert sum(n for n, _ in amounts.values()) == 8
    assert sum(a for _, a in amounts.values()) == sum(o[2] for o in ORDERS[:8])

    _dbt_without_the_pre_hook(dbt_executable, shop_dsn, tmp_path, "2026-10-02")
    assert _orders_per_day(shop_dsn)["2026-10-02"] == (6, 3)
    print(
        f"dbt_shop: first run {first:.1f} s, no-op {again:.1f} s, crashed worker {crashed:.1f} s,"
        f" retry {retry:.1f} s, force {forced:.1f} s"
    )


def test_a_failed_dbt_test_then_a_rerun_keeps_the_built_day_until_forced(
    shop_env: dict[str, str], shop_dsn: str, dbt_executable: str
) -> None:
    """Adversary (issue 34): a day whose build fails its dbt test (a duplicate order in the
    source). The model's run completed, so after the source is fixed a plain rerun of the day
    does not rebuild it: the test fails again on the same build (docs/dbt.md: the model's day
    is completed; force rebuilds it). The run key's environment is gone after a failed task as
    after a passed one, and each model's task has its own job with the day's key."""
    from airflow_idempotency.policy import JOB_ENV, RUN_KEY_ENV

    bag = load_dag_bag(DBT_DAGS)
    assert not bag.import_errors, bag.import_errors
    dag = bag.dags["dbt_shop"]
    rows(shop_dsn, "ALTER TABLE shop.raw_orders DROP CONSTRAINT raw_orders_pkey")
    rows(shop_dsn, "INSERT INTO shop.raw_orders VALUES (9, 1, 5, '2026-10-03')")  # a duplicate
    failed = run_dag(dag, _fire("2026-10-03"))
    states = task_states(failed)
    assert states["orders_daily.run"] == "success" and states["orders_daily.test"] == "failed"
    assert RUN_KEY_ENV not in os.environ and JOB_ENV not in os.environ
    assert _orders_per_day(shop_dsn) == {"2026-10-03": (2, 1)}

    rows(shop_dsn, "DELETE FROM shop.raw_orders WHERE order_id = 9 AND amount = 5")  # fixed
    rerun = run_dag(dag, _fire("2026-10-03"))
    assert task_states(rerun)["orders_daily.test"] == "failed"  # the same build tested again
    assert _builds(shop_dsn)[("orders_daily", "2026-10-03")] == 1

    _run(dag, "2026-10-03", force=True)
    assert _orders_per_day(shop_dsn) == {"2026-10-03": (1, 1)}
    assert _builds(shop_dsn)[("orders_daily", "2026-10-03")] == 2
    keys = rows(
        shop_dsn,
        "SELECT job_name, run_key, status FROM idempotency.job_runs ORDER BY 1",
    )
    assert keys == [
        (f"dbt_shop.{m}.{s}", "2026-10-03", "completed")
        for m in sorted(MODELS)
        for s in ("run", "test")
    ]
