"""The Run keys view on partitioned runs (Airflow 3): a segmented job's calendar, one
segment at a time, and each attempt's partition key linked to Airflow's list of that
partition's runs. In-process, as tests/integration/test_ui_app.py (records written by the real runner)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote

import pytest
from test_ui_app import Client, auth_manager

from airflow_idempotency.records import Trigger
from support.effects import run_once

pytestmark = pytest.mark.usefixtures("airflow_home")
__all__ = ["auth_manager"]  # the module's fixture, shared


def run(dsn: str, key: str, partition_key: str, *, fail: bool = False) -> None:
    """One execution of job ``regional`` of demo_dag for ``key``, from ``partition_key``."""

    def work(_: Any) -> dict[str, int]:
        if fail:
            raise RuntimeError("boom")
        return {"rows": 1}

    trigger = Trigger("backfill", None, "demo_dag", f"backfill__{key}", "t", 1, None, partition_key)
    try:
        run_once(dsn, work, job="regional", run_key=key, trigger=trigger)
    except RuntimeError:
        assert fail


@pytest.fixture
def segmented(airflow_pg_conn: str) -> str:
    for day in ("01", "02", "04"):
        run(airflow_pg_conn, f"eu|2026-10-{day}", f"eu|2026-10-{day}T01:00:00")
    run(airflow_pg_conn, "eu|2026-10-03", "eu|2026-10-03T01:00:00", fail=True)
    for day in ("01", "02"):
        run(airflow_pg_conn, f"us|2026-10-{day}", f"us|2026-10-{day}T01:00:00")
    return airflow_pg_conn


def test_a_segmented_job_has_a_calendar_per_segment(auth_manager: Any, segmented: str) -> None:
    """The calendar of a job keyed eu|day and us|day shows one segment's days (the newest
    key's by default, or the one asked for), names the others, and links each cell to its
    full key."""
    client = Client(auth_manager, "viewer")
    default = client.json("/api/calendar", job="regional")["calendar"]
    assert (default["segment"], default["segments"]) == ("us", ["eu", "us"])
    eu = client.json("/api/calendar", job="regional", segment="eu")["calendar"]
    assert (eu["period"], eu["first_key"], eu["last_key"]) == ("day", "2026-10-01", "2026-10-04")
    cells = [c for r in eu["rows"] for c in r["cells"] if c and c["state"] != "none"]
    assert [(c["run_key"], c["period"], c["state"]) for c in cells] == [
        ("eu|2026-10-01", "2026-10-01", "completed"),
        ("eu|2026-10-02", "2026-10-02", "completed"),
        ("eu|2026-10-03", "2026-10-03", "failed"),
        ("eu|2026-10-04", "2026-10-04", "completed"),
    ]
    page = client.get("/calendar", job="regional", segment="eu")
    assert page.status_code == 200
    assert 'id="segment">eu|' in page.text and "segment=us" in page.text
    assert re.findall(r'data-key="(eu\|2026-10-0\d)" data-state="failed"', page.text) == [
        "eu|2026-10-03"
    ]
    refused = client.get("/api/calendar", job="regional", segment="apac")
    assert refused.status_code == 400 and "no key of segment 'apac'" in refused.text


def test_attempts_show_their_partition_key_linked_to_airflow(
    auth_manager: Any, segmented: str
) -> None:
    """A key's page and its DAG run's tab show each attempt's partition key, linked to
    Airflow's list of the DAG's runs of that partition."""
    client = Client(auth_manager, "viewer")
    detail = client.json("/api/keys", job="regional", run_key="eu|2026-10-03")["key"]
    assert [a["partition_key"] for a in detail["attempts"]] == ["eu|2026-10-03T01:00:00"]
    link = "/dags/demo_dag/runs?partition_key_pattern=" + quote("eu|2026-10-03T01:00:00", safe="")
    page = client.get("/keys", job="regional", run_key="eu|2026-10-03")
    assert link in page.text.replace("&amp;", "&")
    tab = client.get("/dags/demo_dag/runs/backfill__eu|2026-10-03")
    assert tab.status_code == 200 and link in tab.text.replace("&amp;", "&")
