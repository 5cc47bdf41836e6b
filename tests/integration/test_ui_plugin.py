"""The plugin on both Airflow lines: Airflow finds it, it imports nothing heavy, and the
operator's "Run key" extra link points at the key the task ran (Airflow 3) or at the view's
page that finds it (Airflow 2.11)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pendulum
import pytest
from airflow.providers.common.compat.sdk import DAG

from airflow_idempotency import IdempotentRunOperator
from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS
from support.dag_runs import SUCCESS, airflow3_only, daily_trigger, run_dag, utc

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]

HEAVY = (
    "fastapi",
    "starlette",
    "jinja2",
    "psycopg",
    "airflow_idempotency.ui.app",
    "airflow_idempotency.ui.reads",
    "airflow_idempotency.ui.calendar",
    "airflow_idempotency.compat",
)


def test_airflow_lists_the_plugin_without_import_errors() -> None:
    """`airflow plugins` finds the plugin through its entry point, on each line, with no
    import error; on Airflow 3 it brings the app and the three views (nav, at the top level
    with an icon; DAG; DAG run), on 2.11 the Flask AppBuilder view and the link's class."""
    proc = subprocess.run(
        [sys.executable, "-m", "airflow", "plugins", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    listing = json.loads(proc.stdout[proc.stdout.index("[") :])
    (plugin,) = [p for p in listing if p["name"] == "idempotency"]
    assert "airflow-provider-idempotency" in str(plugin["source"])
    assert "Failed to import plugin" not in proc.stdout + proc.stderr
    if AIRFLOW_V_3_0_PLUS:
        assert [app["url_prefix"] for app in plugin["fastapi_apps"]] == ["/idempotency"]
        destinations = {v["destination"]: v["href"] for v in plugin["external_views"]}
        assert destinations == {
            "nav": "idempotency/",
            "dag": "idempotency/dags/{DAG_ID}",
            "dag_run": "idempotency/dags/{DAG_ID}/runs/{RUN_ID}",
        }
        (nav,) = [v for v in plugin["external_views"] if v["destination"] == "nav"]
        assert str(nav["nav_top_level"]) == "True" and "category" not in nav  # the CLI says "True"
        assert nav["icon"].startswith("data:image/svg+xml,")
        assert nav["icon_dark_mode"].startswith("data:image/svg+xml,")
        assert not plugin["appbuilder_views"] and not plugin["operator_extra_links"]
    else:
        assert [v["name"] for v in plugin["appbuilder_views"]] == ["Run keys"]
        assert "RunKeyLink" in str(plugin["operator_extra_links"])


def test_the_plugin_module_imports_nothing_heavy() -> None:
    """Importing and instantiating the plugin, as every task process does, loads neither the
    app nor FastAPI, psycopg, Jinja or the compat module (bench/ui.py measures the time)."""
    loaded = (
        "airflow.sdk.execution_time.task_runner"
        if AIRFLOW_V_3_0_PLUS
        else "airflow.models.taskinstance"
    )
    code = (
        "import sys\n"
        f"import {loaded}  # what a task process has loaded when it integrates plugins\n"
        f"heavy = {HEAVY!r}\n"
        "before = {m for m in heavy if m in sys.modules}\n"
        "from airflow_idempotency.plugin import IdempotencyPlugin\n"
        "IdempotencyPlugin()\n"
        "print(sorted(m for m in heavy if m in sys.modules and m not in before))\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "error::DeprecationWarning"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_extra_link_names_the_key_on_each_line(airflow_pg_conn: str) -> None:
    """A task of the operator has a "Run key" link: on Airflow 3 to its key's page in
    Airflow's own page (computed by the worker), on 2.11 to the view's page that finds the
    key of the task's newest attempt."""
    names = [link.name for link in IdempotentRunOperator.operator_extra_links]
    assert names == ["Run key"]
    if not AIRFLOW_V_3_0_PLUS:
        from airflow_idempotency.links import RunKeyLink

        class Key:
            dag_id, run_id, task_id, map_index = "d", "manual__2026-10-01T00:00:00+00:00", "t", -1

        assert RunKeyLink().get_link(None, ti_key=Key()) == (
            "/runkeys/task?dag_id=d&run_id=manual__2026-10-01T00%3A00%3A00%2B00%3A00&task_id=t"
        )
        return
    with DAG(
        "ui_link", schedule=daily_trigger(), start_date=pendulum.datetime(2026, 1, 1, tz="UTC")
    ) as dag:
        IdempotentRunOperator(task_id="work", python_callable=lambda run: {"n": 1})
        bad = IdempotentRunOperator(task_id="bad", python_callable=lambda run: None)
    # Blank job names are refused where the DAG is parsed; set one afterwards so that the
    # task fails at run time, before its key is known.
    bad.job_name = "  "
    run = run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    assert run.state != SUCCESS  # "bad" refuses its blank job name
    links = {
        ti.task_id: xcom_value(run, ti.task_id, "_link_RunKeyLink")
        for ti in run.get_task_instances()
    }
    assert links == {
        "work": "/plugin/run-keys/idempotency/keys?job=ui_link.work&run_key=2026-10-01",
        "bad": f"/plugin/run-keys/idempotency/dags/ui_link/runs/{quote(run.run_id)}?task_id=bad",
    }


@airflow3_only
def test_extra_link_follows_the_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a sub-path ([api] base_url) the link keeps it, and odd job names are encoded."""
    from airflow_idempotency.links import RunKeyLink

    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.com/team-a/")

    class Key:
        dag_id, run_id, task_id = "d", "manual__2026-10-01T00:00:00+00:00", "t"

    class Operator:
        run_key_link_target = ("a&b job", "2026-10-01")

    assert RunKeyLink().get_link(Operator(), ti_key=Key()) == (
        "/team-a/plugin/run-keys/idempotency/keys?job=a%26b+job&run_key=2026-10-01"
    )


def quote(text: str) -> str:
    from urllib.parse import quote as _quote

    return _quote(text, safe="")


def xcom_value(run: Any, task_id: str, key: str) -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        value = session.scalar(
            select(XComModel.value).where(
                XComModel.dag_id == run.dag_id,
                XComModel.run_id == run.run_id,
                XComModel.task_id == task_id,
                XComModel.key == key,
            )
        )
    return value  # a JSON column: the link, decoded
