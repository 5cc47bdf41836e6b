"""The Run keys view of Airflow 2.11 in process (Flask AppBuilder's app, a signed-in admin):
every malformed parameter is a 400 that says what to send, never a 500 (issue 31: a
malformed ``map_index`` was an internal error), and nothing is written.

tests/stack/test_ui_airflow2.py serves the same view from a real webserver.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from support.db import rows

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.airflow2_only]

LONG = "k" * 401
TASK = {"dag_id": "d", "run_id": "r", "task_id": "t"}


@pytest.fixture
def admin(airflow_pg_conn: str) -> Iterator[Any]:
    """Airflow 2.11's web app with the plugin's view, and a client signed in as an Admin;
    one key recorded by task t of DAG d's run r."""
    import psycopg
    from airflow.www.app import create_app

    from airflow_idempotency.records import Trigger
    from airflow_idempotency.runner import run_idempotently

    run_idempotently(
        connect=lambda: psycopg.connect(airflow_pg_conn),
        job_name="d.t",
        run_key="2026-10-01",
        work=lambda ctx: None,
        trigger=Trigger("manual", "alice", "d", "r", "t", 1),
    )

    app = create_app(testing=True)
    app.config["WTF_CSRF_ENABLED"] = False
    security = app.appbuilder.sm
    security.sync_roles()
    if security.find_user(username="admin") is None:
        role = security.find_role("Admin")
        assert security.add_user("admin", "a", "b", "admin@example.com", role, "admin")
    client = app.test_client()
    signed_in = client.post("/login/", data={"username": "admin", "password": "admin"})
    assert signed_in.status_code in (200, 302), signed_in.data[:500]
    yield client


# (path, parameters, what the 400 says)
REFUSED = [
    ("/runkeys/task", {**TASK, "map_index": "x"}, "map_index must be -1"),
    ("/runkeys/task", {**TASK, "map_index": "-2"}, "map_index must be -1"),
    ("/runkeys/task", {**TASK, "map_index": "99999999999"}, "map_index must be -1"),
    ("/runkeys/task", {**TASK, "map_index": "\u0663"}, "in ASCII digits"),
    ("/runkeys/task", {**TASK, "map_index": "1 "}, "map_index must be -1"),
    ("/runkeys/task", {**TASK, "dag_id": "d\x00"}, "dag_id: holds U+0000"),
    ("/runkeys/task", {"dag_id": "d", "run_id": "r"}, "task_id: required"),
    ("/runkeys/api/keys", {"job": "j", "run_key": "k\x00"}, "run_key: holds U+0000"),
    ("/runkeys/api/keys", {"job": LONG, "run_key": "k"}, "job: longer than 400"),
    ("/runkeys/api/keys", {"job": "j", "run_key": "k", "x": "1"}, "x: not a parameter"),
    ("/runkeys/api/overview", {"status": "ok"}, "status: must be one of"),
    ("/runkeys/api/overview", {"from": "b", "to": "a"}, "swap them"),
    ("/runkeys/api/calendar", {"job": "d.t", "from": "2026-10-05", "to": "2026-10-01"}, "after"),
    ("/runkeys/api/calendar", {}, "job: required"),
    ("/runkeys/api/locks", {"limit": "-1"}, "limit: not a parameter of this page"),
    ("/runkeys/api/dags/d%00x", {}, "dag_id: holds U+0000"),
    ("/runkeys/page/dags/d/runs/r", {"task_id": "\x1b"}, "task_id: holds U+001B"),
    # Sent twice: Flask's to_dict kept the first, FastAPI the last; both now refuse.
    ("/runkeys/api/overview", {"job": ["a", "b"]}, "job: sent 2 times; send it once"),
    ("/runkeys/api/keys", {"job": "j", "run_key": ["k", "l"]}, "run_key: sent 2 times"),
    ("/runkeys/task", {**TASK, "map_index": ["0", "1"]}, "map_index: sent 2 times"),
]


def test_every_malformed_parameter_is_a_400_on_airflow_2(admin: Any, airflow_pg_conn: str) -> None:
    """Each malformed parameter of the task link, the JSON twins and the pages: a 400 whose
    message names the parameter and what to send (JSON under /api, else the error page);
    no 500, no traceback; the job database is unchanged."""
    before = rows(airflow_pg_conn, "SELECT count(*) FROM idempotency.job_runs")
    for path, params, says in REFUSED:
        answer = admin.get(path, query_string=params)
        text = answer.get_data(as_text=True)
        assert answer.status_code == 400, (path, params, answer.status_code, text[:800])
        assert says in text.replace("&#39;", "'"), (path, params, text[:800])
        assert "Traceback" not in text
        if "/api/" in path:
            assert answer.get_json()["detail"], text
    assert rows(airflow_pg_conn, "SELECT count(*) FROM idempotency.job_runs") == before


def test_a_well_formed_map_index_finds_the_task(admin: Any) -> None:
    """``map_index`` -1 or empty (not mapped): the link opens the key the task recorded; a
    whole number the attempts of that mapped instance (none recorded: the run's page)."""
    for value in ("-1", ""):
        answer = admin.get("/runkeys/task", query_string={**TASK, "map_index": value})
        assert answer.status_code == 302, (value, answer.get_data(as_text=True)[:500])
        assert answer.headers["Location"].endswith("/runkeys/keys?job=d.t&run_key=2026-10-01")
    for value in ("0", "7", str(2**31 - 1)):
        answer = admin.get("/runkeys/task", query_string={**TASK, "map_index": value})
        assert answer.status_code == 302, (value, answer.get_data(as_text=True)[:500])
        assert answer.headers["Location"].endswith("/runkeys/dags/d/runs/r?task_id=t")
