"""The Run keys view's app (Airflow 3), in-process: Airflow's authentication and per-DAG
authorization, what each page shows from records the real runner wrote, and its refusals.

The app is the plugin's own FastAPI app, unmounted (TestClient), with Airflow's auth manager
initialised as the api-server does; tests/stack/test_ui_stack.py serves it from a real api-server.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_idempotency._sql import latest_migration
from airflow_idempotency.compat import AIRFLOW_V_3_2_PLUS
from airflow_idempotency.records import Trigger
from airflow_idempotency.runner import RunContext, run_idempotently
from airflow_idempotency.ui.database import POOLS
from devtools import airflow_env
from support.auth_manager import DENIED_ENV
from support.dag_runs import register
from support.db import rows
from support.locks import key_held

pytestmark = pytest.mark.usefixtures("airflow_home")

DAGS = ("demo_dag", "secret_dag", "other_dag")
HOSTILE_JOB = "<img src=x onerror=alert(1)>"
HOSTILE_KEY = "\"'><script>alert(2)</script>"


@pytest.fixture(scope="module")
def auth_manager(airflow_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Airflow's auth manager as the api-server initialises it: SimpleAuthManager with users
    of each role, and per-DAG rules (``restricted`` may not read secret_dag)."""
    from airflow.api_fastapi.app import init_auth_manager
    from airflow.providers.common.compat.sdk import DAG, BaseOperator

    passwords = tmp_path_factory.mktemp("auth") / "passwords.json"
    passwords.write_text(json.dumps({u: u for u in ("admin", "viewer", "restricted", "user")}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW__CORE__AUTH_MANAGER", "support.auth_manager.RestrictedAuthManager")
        mp.setenv(
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS",
            "admin:admin,viewer:viewer,restricted:viewer,user:user",
        )
        mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", str(passwords))
        mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "False")
        mp.setenv(DENIED_ENV, json.dumps({"restricted": ["secret_dag"]}))
        for dag_id in DAGS:
            with DAG(dag_id, schedule=None) as dag:
                BaseOperator(task_id="t")
            register(dag)
        yield init_auth_manager()


def token(manager: Any, name: str, role: str) -> str:
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return str(manager.generate_jwt(SimpleAuthManagerUser(username=name, role=role)))


class Client:
    """The app's TestClient, signed in as one user (the UI's ``_token`` cookie)."""

    def __init__(
        self,
        manager: Any,
        name: str | None,
        role: str = "viewer",
        settings: Any = None,
        **kwargs: Any,
    ) -> None:
        from fastapi.testclient import TestClient

        from airflow_idempotency.ui.app import Settings, create_app

        app = create_app(settings or Settings())
        self.http = TestClient(app, follow_redirects=False, **kwargs)
        if name is not None:
            self.http.cookies.set("_token", token(manager, name, role))

    def get(self, path: str, **params: Any) -> Any:
        return self.http.get(path, params=params)

    def json(self, path: str, **params: Any) -> Any:
        response = self.get(path, **params)
        assert response.status_code == 200, (response.status_code, response.text[:2000])
        return response.json()


def run(
    dsn: str, job: str, key: str, dag_id: str | None, *, fail: bool = False, run_id: str = "r1"
) -> None:
    """One execution through the real runner, recorded as task ``t`` of ``dag_id``'s run."""

    def work(ctx: RunContext) -> dict[str, int]:
        if fail:
            raise RuntimeError(f"boom in {job}")
        return {"rows": 7}

    trigger = Trigger(
        "manual", "alice", dag_id, run_id if dag_id else None, "t" if dag_id else None, 1
    )
    try:
        run_idempotently(
            connect=lambda: psycopg.connect(dsn),
            job_name=job,
            run_key=key,
            work=work,
            trigger=trigger,
        )
    except RuntimeError:
        assert fail


def add_effects(dsn: str, job: str, key: str, **statuses: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for status, count in statuses.items():
            for i in range(count):
                conn.execute(
                    "INSERT INTO idempotency.outbound_ledger (remote_system, idempotency_key,"
                    " job_name, run_key, request_fingerprint, status, last_error)"
                    " VALUES ('accounting', %s, %s, %s, 'f', %s, %s)",
                    (
                        f"{job}:{key}:{status}:{i}",
                        job,
                        key,
                        status,
                        "refused" if status == "failed" else None,
                    ),
                )


@pytest.fixture
def seeded(airflow_pg_conn: str) -> str:
    """A job database with records of three DAGs, a job run outside Airflow, a job shared by
    two DAGs, a failed and an interrupted key, and ledger rows."""
    dsn = airflow_pg_conn
    run(dsn, "demo_dag.load", "2026-10-01", "demo_dag")
    run(dsn, "demo_dag.load", "2026-10-02", "demo_dag", fail=True, run_id="r2")
    run(dsn, "demo_dag.load", "2026-10-03", "demo_dag", run_id="r3")
    run(dsn, "shared.reconcile", "2026-10-01", "demo_dag")
    run(dsn, "shared.reconcile", "2026-10-01", "secret_dag")  # a no-op by the other DAG
    run(dsn, "secret_dag.pay", "2026-10-01", "secret_dag")
    run(dsn, "script.job", "2026-10-01", None)
    run(dsn, HOSTILE_JOB, HOSTILE_KEY, "demo_dag")
    # The worker of 2026-10-03 "died" after starting: started, and nobody holds the lock.
    rows(
        dsn,
        "UPDATE idempotency.job_runs SET status = 'started', completed_at = NULL"
        " WHERE job_name = 'demo_dag.load' AND run_key = '2026-10-03'",
    )
    add_effects(dsn, "demo_dag.load", "2026-10-01", succeeded=2, pending=1, failed=1)
    add_effects(dsn, "secret_dag.pay", "2026-10-01", pending=3)
    return dsn


def keys_of(runs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(r["job_name"], r["run_key"]) for r in runs}


# The view asks the auth manager for its login URL with next_url; Airflow's SimpleAuthManager
# puts it in the URL (back to the page after the login) from 3.3 on; 3.0 to 3.2 drop it.
def login_keeps_next(auth_manager: Any) -> bool:
    return "next=" in auth_manager.get_url_login(next_url="/x")


def test_pages_need_an_airflow_session(auth_manager: Any, seeded: str) -> None:
    """Without a token a page redirects to Airflow's login (and back), the JSON answers 401,
    and a forged token is refused."""
    anonymous = Client(auth_manager, None)
    page = anonymous.get("/keys", job="demo_dag.load", run_key="2026-10-01")
    assert page.status_code == 303
    if login_keeps_next(auth_manager):
        assert re.match(
            r"^/auth/login\?next=.*%2Fkeys%3Fjob%3Ddemo_dag.load", page.headers["location"]
        )
    else:
        assert page.headers["location"] == "/auth/login"
    assert anonymous.get("/api/overview").status_code == 401
    anonymous.http.cookies.set("_token", "not-a-jwt")
    assert anonymous.get("/api/overview").status_code == 403


def test_admin_sees_every_record(auth_manager: Any, seeded: str) -> None:
    """An admin reads the records of every DAG and those written outside Airflow: the counts,
    the interrupted key, the unconfirmed effects and every run key."""
    data = Client(auth_manager, "admin", "admin").json("/api/overview")["overview"]
    assert keys_of(data["runs"]) == {
        ("demo_dag.load", "2026-10-01"),
        ("demo_dag.load", "2026-10-02"),
        ("demo_dag.load", "2026-10-03"),
        ("shared.reconcile", "2026-10-01"),
        ("secret_dag.pay", "2026-10-01"),
        ("script.job", "2026-10-01"),
        (HOSTILE_JOB, HOSTILE_KEY),
    }
    assert data["counts"] == {"failed": 1, "running": 0, "interrupted": 1}
    assert [(r["job_name"], r["run_key"], r["state"]) for r in data["attention"]] == [
        ("demo_dag.load", "2026-10-03", "interrupted"),
        ("demo_dag.load", "2026-10-02", "failed"),
    ]
    assert "boom in demo_dag.load" in data["attention"][1]["details"]["last_error"]
    assert {
        (u["job_name"], u["remote_system"], u["pending"], u["failed"]) for u in data["unconfirmed"]
    } == {("demo_dag.load", "accounting", 1, 1), ("secret_dag.pay", "accounting", 3, 0)}
    # Newest key first, then job name descending.
    dated = [(r["run_key"], r["job_name"]) for r in data["runs"] if r["run_key"].startswith("2026")]
    assert dated[:3] == [
        ("2026-10-03", "demo_dag.load"),
        ("2026-10-02", "demo_dag.load"),
        ("2026-10-01", "shared.reconcile"),
    ]


def test_a_user_sees_only_the_dags_the_auth_manager_authorizes(
    auth_manager: Any, seeded: str
) -> None:
    """A user who may not read secret_dag gets none of its records anywhere (runs, effects,
    its tab, its keys), nor records written outside Airflow; a key of a job shared with
    secret_dag shows without secret_dag's attempt, counted as hidden."""
    client = Client(auth_manager, "restricted")
    data = client.json("/api/overview")["overview"]
    seen = keys_of(data["runs"])
    assert ("secret_dag.pay", "2026-10-01") not in seen and ("script.job", "2026-10-01") not in seen
    assert ("demo_dag.load", "2026-10-01") in seen
    assert {u["job_name"] for u in data["unconfirmed"]} == {"demo_dag.load"}
    assert client.get("/dags/secret_dag").status_code == 403
    assert client.get("/api/dags/secret_dag/runs/r1").status_code == 403
    assert client.get("/api/keys", job="secret_dag.pay", run_key="2026-10-01").status_code == 404
    assert client.get("/api/keys", job="script.job", run_key="2026-10-01").status_code == 404
    shared = client.json("/api/keys", job="shared.reconcile", run_key="2026-10-01")["key"]
    assert [a["dag_id"] for a in shared["attempts"]] == ["demo_dag"]
    assert (shared["attempts_total"], shared["attempts_hidden"]) == (1, 1)
    page = client.get("/keys", job="shared.reconcile", run_key="2026-10-01").text
    assert "1 more by DAGs you may not read" in page and "secret_dag" not in page
    # The same key, for someone who may read every DAG, has both attempts.
    everything = Client(auth_manager, "viewer").json(
        "/api/keys", job="shared.reconcile", run_key="2026-10-01"
    )
    assert [a["outcome"] for a in everything["key"]["attempts"]] == ["noop", "completed"]


def test_dag_tab_is_a_grid_of_run_keys_by_job(auth_manager: Any, seeded: str) -> None:
    """A DAG's tab lists the jobs it ran as columns and its run keys newest first, each cell
    the job's state for that key; older keys come a page at a time."""
    client = Client(auth_manager, "viewer")
    data = client.json("/api/dags/demo_dag")["dag"]
    assert data["jobs"] == sorted(["demo_dag.load", "shared.reconcile", HOSTILE_JOB])
    grid = {key: {job: cell["state"] for job, cell in cells.items()} for key, cells in data["keys"]}
    assert grid["2026-10-01"] == {"demo_dag.load": "completed", "shared.reconcile": "completed"}
    assert grid["2026-10-02"] == {"demo_dag.load": "failed"}
    assert grid["2026-10-03"] == {"demo_dag.load": "interrupted"}
    older = client.json("/api/dags/demo_dag", before_key="2026-10-02")["dag"]
    assert [key for key, _ in older["keys"] if key.startswith("2026")] == ["2026-10-01"]
    empty = client.get("/dags/other_dag")
    assert empty.status_code == 200 and 'id="no-jobs"' in empty.text


def test_run_tab_shows_what_each_task_of_the_run_did(auth_manager: Any, seeded: str) -> None:
    """A DAG run's tab lists its attempts with the key's current state; ``task_id`` narrows it."""
    client = Client(auth_manager, "viewer")
    attempts = client.json("/api/dags/demo_dag/runs/r2")["run"]["attempts"]
    assert [(a["job_name"], a["run_key"], a["outcome"], a["key_state"]) for a in attempts] == [
        ("demo_dag.load", "2026-10-02", "failed", "failed")
    ]
    assert "boom in demo_dag.load" in attempts[0]["error"]
    assert client.json("/api/dags/demo_dag/runs/r2", task_id="other")["run"]["attempts"] == []
    page = client.get("/dags/demo_dag/runs/r2").text
    assert 'href="/dags/demo_dag/runs/r2/tasks/t"' in page  # the task instance in Airflow's UI


def test_key_page_shows_the_record_attempts_lock_holder_and_ledger(
    auth_manager: Any, seeded: str
) -> None:
    """A key's page has its record, every attempt, who holds its lock right now (a run in
    progress in another thread) and its effects by status with the unconfirmed ones listed."""
    client = Client(auth_manager, "viewer")
    detail = client.json("/api/keys", job="demo_dag.load", run_key="2026-10-01")["key"]
    assert detail["run"]["state"] == "completed" and detail["run"]["details"] == {"rows": 7}
    assert {(e["status"], e["effects"]) for e in detail["effects"]} == {
        ("succeeded", 2),
        ("pending", 1),
        ("failed", 1),
    }
    assert {u["status"] for u in detail["unconfirmed"]} == {"pending", "failed"}
    assert detail["lock_holder"] is None

    with key_held(seeded, "demo_dag.load", "2026-10-04", scheduled("r4")):
        live = client.json("/api/keys", job="demo_dag.load", run_key="2026-10-04")["key"]
        assert live["run"]["state"] == "running"
        assert live["lock_holder"]["attempt_run_id"] == "r4"
        overview = client.json("/api/overview")["overview"]
        assert overview["counts"]["running"] == 1
        assert [(lock["run_key"], lock["run_id"]) for lock in overview["locks"]] == [
            ("2026-10-04", "r4")
        ]
    assert (
        client.json("/api/keys", job="demo_dag.load", run_key="2026-10-04")["key"]["run"]["state"]
        == "completed"
    )


@pytest.mark.skipif(
    not AIRFLOW_V_3_2_PLUS,
    reason="Airflow 3.1's execution API dies in _get_upstream_map_indexes when dag.test runs "
    "this DAG (an error of 3.1's own, not of the task); 3.2 and 3.3 run it",
)
def test_attempts_show_where_they_came_from_in_airflow(
    auth_manager: Any, airflow_pg_conn: str
) -> None:
    """A task run through dag.test (Airflow's real task context): the key's page and the DAG
    run's tab show each attempt's run type, task instance id and DAG version as Airflow
    recorded them, and the JSON carries them with the clear number."""
    from airflow_idempotency import IdempotentRunOperator
    from support.dag_runs import SUCCESS, daily_dag, run_dag, utc

    with daily_dag("demo_dag") as dag:
        IdempotentRunOperator(task_id="prov", python_callable=lambda run: None)
    dag_run = run_dag(dag, logical_date=utc(2026, 10, 2, 1))
    assert dag_run.state == SUCCESS
    (ti,) = [ti for ti in dag_run.get_task_instances() if ti.task_id == "prov"]
    client = Client(auth_manager, "viewer")
    (attempt,) = client.json("/api/keys", job="demo_dag.prov", run_key="2026-10-01")["key"][
        "attempts"
    ]
    assert (attempt["ti_id"], attempt["dag_version_id"]) == (str(ti.id), str(ti.dag_version_id))
    assert (attempt["run_type"], attempt["clear_number"]) == ("manual", dag_run.clear_number)
    key_page = client.get("/keys", job="demo_dag.prov", run_key="2026-10-01").text
    for page in (key_page, client.get(f"/dags/demo_dag/runs/{dag_run.run_id}").text):
        assert f"ti {ti.id}" in page and f"version {ti.dag_version_id}" in page
        assert "<span data-run-type>manual</span>" in page


def test_pages_escape_what_the_records_hold(auth_manager: Any, seeded: str) -> None:
    """Job names, run keys and errors are shown as text: markup in them never reaches the
    page as markup, and links to them are URL-encoded."""
    client = Client(auth_manager, "admin", "admin")
    for response in (
        client.get("/"),
        client.get("/dags/demo_dag"),
        client.get("/keys", job=HOSTILE_JOB, run_key=HOSTILE_KEY),
    ):
        assert response.status_code == 200
        assert "<img src=x" not in response.text and "<script>alert(2)" not in response.text
        assert "&lt;img src=x onerror=alert(1)&gt;" in response.text


def test_rerun_is_offered_to_users_who_may_trigger_the_dag(auth_manager: Any, seeded: str) -> None:
    """The rerun form (which posts to Airflow's REST API) is on a key's page and the DAG's
    tab for a user who may trigger the DAG, not for a viewer."""
    as_user = Client(auth_manager, "user", "user")
    page = as_user.get("/keys", job="demo_dag.load", run_key="2026-10-02").text
    assert 'class="rerun" data-run-key="2026-10-02"' in page
    assert 'data-api="/api/v2/dags/demo_dag/dagRuns"' in page
    assert 'class="rerun"' in as_user.get("/dags/demo_dag").text
    as_viewer = Client(auth_manager, "viewer")
    assert (
        'class="rerun"'
        not in as_viewer.get("/keys", job="demo_dag.load", run_key="2026-10-02").text
    )
    assert 'class="rerun"' not in as_viewer.get("/dags/demo_dag").text


def test_links_follow_the_root_path(auth_manager: Any, seeded: str) -> None:
    """Under a root path (Airflow's [api] base_url, then the mount) every link keeps it: the
    app's pages, Airflow's pages and the REST API the rerun posts to."""
    client = Client(auth_manager, "user", "user", root_path="/airflow/idempotency")
    page = client.get("/keys", job="demo_dag.load", run_key="2026-10-02").text
    assert 'href="/airflow/idempotency/?job=demo_dag.load"' in page
    assert 'href="/airflow/dags/demo_dag/runs/r2"' in page
    assert 'data-api="/airflow/api/v2/dags/demo_dag/dagRuns"' in page


def test_unreadable_database_is_explained_and_never_changed(
    auth_manager: Any, pg_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database without the tables, an older schema, an unknown connection: each page says
    why (503) and what to do, and nothing is created or migrated."""
    client = Client(auth_manager, "viewer")
    name = pg_server.create_database("idem_ui_empty")
    try:
        dsn = pg_server.dsn(name)
        for name, value in airflow_env.connection_env(dsn).items():
            monkeypatch.setenv(name, value)
        page = client.get("/")
        assert page.status_code == 503
        assert "has no bookkeeping tables" in page.text and "ui_conn_id" in page.text
        assert rows(dsn, "SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'") == [
            (0,)
        ]

        run(dsn, "j", "2026-10-01", "demo_dag")
        # The newest migration not applied (whichever number it has): an older schema.
        rows(
            dsn,
            "DELETE FROM idempotency.schema_version"
            " WHERE version = (SELECT max(version) FROM idempotency.schema_version)",
        )
        older = client.get("/api/overview")
        assert older.status_code == 503 and "older than this code" in older.json()["detail"]
        ((left,),) = rows(dsn, "SELECT max(version) FROM idempotency.schema_version")
        assert left < latest_migration()
    finally:
        pg_server.drop_database(name)
    monkeypatch.delenv("AIRFLOW_CONN_IDEMPOTENCY_DEFAULT")
    missing = client.get("/")
    assert missing.status_code == 503 and "idempotency_default" in missing.text


def test_a_role_that_may_only_select_is_enough(
    auth_manager: Any,
    seeded: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every page works through a database role that may only read the bookkeeping tables;
    a read the database refuses is a page that says so (503) with an error id, whose log
    record has the database's own text (never shown to the user)."""
    role = "idem_ui_reader"
    with psycopg.connect(seeded, autocommit=True) as conn:
        conn.execute(f"DROP ROLE IF EXISTS {role}")
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA idempotency TO {role}")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA idempotency TO {role}")
        conn.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA idempotency TO {role}")
    try:
        as_role = psycopg.conninfo.make_conninfo(seeded, user=role)
        for name, value in airflow_env.connection_env(as_role).items():
            monkeypatch.setenv(name, value)
        client = Client(auth_manager, "admin", "admin")
        for path, params_ in (
            ("/", {}),
            ("/dags/demo_dag", {}),
            ("/dags/demo_dag/runs/r1", {}),
            ("/keys", {"job": "demo_dag.load", "run_key": "2026-10-01"}),
            ("/calendar", {"job": "demo_dag.load"}),
            ("/locks", {}),
        ):
            response = client.get(path, **params_)
            assert response.status_code == 200, (path, response.text[:1000])
        with psycopg.connect(seeded, autocommit=True) as conn:
            conn.execute(f"REVOKE SELECT ON idempotency.job_runs FROM {role}")
        with caplog.at_level(logging.ERROR, logger="airflow_idempotency.ui.database"):
            refused = client.get("/")
            refused_json = client.get("/api/overview")
        assert refused.status_code == 503 and refused_json.status_code == 503
        # The user gets a short message with an id; the log has the database's own text.
        (error_id,) = re.findall(r"error id ([0-9a-f]{8})", refused.text)
        assert "InsufficientPrivilege" not in refused.text and "permission" not in refused.text
        assert "error id" in refused_json.json()["detail"]
        logged = [r for r in caplog.records if error_id in r.getMessage()]
        assert len(logged) == 1 and "InsufficientPrivilege" in logged[0].getMessage()
        assert "job_runs" in logged[0].getMessage()
    finally:
        POOLS.close()  # the role's sessions in the view's pool
        with psycopg.connect(seeded, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def test_the_job_database_is_named_in_airflow_config(
    auth_manager: Any, seeded: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[idempotency] ui_conn_id and ui_schema (here from the environment) choose the job
    database and the schema the view reads."""
    from airflow_idempotency.ui.app import Settings

    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__UI_CONN_ID", "jobs_db")
    monkeypatch.setenv("AIRFLOW_CONN_JOBS_DB", airflow_env.airflow_connection_json(seeded))
    monkeypatch.delenv("AIRFLOW_CONN_IDEMPOTENCY_DEFAULT")
    settings = Settings.from_airflow_config()
    assert settings == Settings(conn_id="jobs_db", schema="idempotency")
    client = Client(auth_manager, "viewer", settings=settings)
    assert client.json("/api/overview")["overview"]["counts"]["failed"] == 1
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__UI_SCHEMA", "elsewhere")
    other = Client(auth_manager, "viewer", settings=Settings.from_airflow_config())
    page = other.get("/")
    assert page.status_code == 503 and "schema &#39;elsewhere&#39;" in page.text


JSON_ENDPOINTS: tuple[tuple[str, dict[str, str]], ...] = (
    ("/api/overview", {}),
    ("/api/dags/demo_dag", {}),
    ("/api/dags/demo_dag/runs/r1", {}),
    ("/api/keys", {"job": "demo_dag.load", "run_key": "2026-10-01"}),
    ("/api/calendar", {"job": "demo_dag.load"}),
    ("/api/locks", {}),
)


@pytest.mark.parametrize(("path", "params"), JSON_ENDPOINTS, ids=[p for p, _ in JSON_ENDPOINTS])
def test_every_json_endpoint_answers_401_without_a_session(
    auth_manager: Any, seeded: str, path: str, params: dict[str, str]
) -> None:
    """Anonymous: each JSON endpoint answers 401 (its HTML page redirects to the login)."""
    anonymous = Client(auth_manager, None)
    response = anonymous.get(path, **params)
    assert response.status_code == 401, response.text
    assert "location" not in response.headers
    page = anonymous.get(path.removeprefix("/api").replace("/overview", "/"), **params)
    login = "/auth/login?next=" if login_keeps_next(auth_manager) else "/auth/login"
    assert page.status_code == 303 and page.headers["location"].startswith(login)


def scheduled(run_id: str, dag_id: str = "demo_dag") -> Trigger:
    """The trigger of task ``t`` of a scheduled run ``run_id`` of ``dag_id``, try 1."""
    return Trigger("scheduled", None, dag_id, run_id, "t", 1)


def test_calendar_colours_each_period_of_a_job(auth_manager: Any, seeded: str) -> None:
    """A job's calendar: its days in rows of months, each completed, failed, interrupted,
    running (locked now) or missing (a gap between its first and newest key), the counts of
    each, the sums of its completed days' details; JSON and HTML say the same."""
    run(seeded, "demo_dag.load", "2026-10-06", "demo_dag", run_id="r6")
    client = Client(auth_manager, "viewer")
    with key_held(seeded, "demo_dag.load", "2026-10-05", scheduled("r5")):
        cal = client.json("/api/calendar", job="demo_dag.load")["calendar"]
        page = client.get("/calendar", job="demo_dag.load")
    assert (cal["period"], cal["first_key"], cal["last_key"]) == ("day", "2026-10-01", "2026-10-06")
    # By default the twelve months up to the newest key's, whole.
    assert (cal["from_key"], cal["to_key"]) == ("2025-11-01", "2026-10-31")
    assert [r["label"] for r in cal["rows"]][::11] == ["2025-11", "2026-10"]
    october = cal["rows"][-1]["cells"]
    states = {c["run_key"]: c["state"] for c in october if c and c["state"] != "none"}
    assert states == {
        "2026-10-01": "completed",
        "2026-10-02": "failed",
        "2026-10-03": "interrupted",
        "2026-10-04": "missing",
        "2026-10-05": "running",
        "2026-10-06": "completed",
    }
    assert [c["locked"] for c in october[:6]] == [False, False, False, False, True, False]
    assert cal["rows"][3]["cells"][28:] == [None, None, None]  # February 2026 has 28 days
    assert cal["counts"] == {
        "completed": 2, "failed": 1, "running": 1, "interrupted": 1, "locked": 0, "missing": 1,
    }  # fmt: skip
    assert cal["totals"] == {"rows": 14}
    assert cal["earlier"] is None and cal["later"] is None
    assert page.status_code == 200
    shown = dict(re.findall(r'data-key="([^"]+)" data-state="([^"]+)"', page.text))
    assert shown == states
    assert 'class="cal-running locked"' in page.text
    # A window of one's own, and the pages around it.
    week = client.json(
        "/api/calendar", job="demo_dag.load", **{"from": "2026-10-02", "to": "2026-10-04"}
    )
    cells = [c for r in week["calendar"]["rows"] for c in r["cells"] if c]
    assert [(c["run_key"], c["state"]) for c in cells] == [
        ("2026-10-02", "failed"), ("2026-10-03", "interrupted"), ("2026-10-04", "missing"),
    ]  # fmt: skip
    assert week["calendar"]["earlier"] == ["2026-09-01", "2026-09-30"]
    assert week["calendar"]["later"] == ["2026-11-01", "2026-11-30"]


def test_calendar_is_reachable_and_filtered(auth_manager: Any, seeded: str) -> None:
    """The overview lists every job with its latest completed key and links its calendar,
    as do the DAG tab's columns and a key's page; a user barred from a DAG gets neither its
    jobs nor their calendars; a key that names no period has no calendar."""
    client = Client(auth_manager, "restricted")
    jobs = client.json("/api/overview")["overview"]["jobs"]
    assert {
        j["job_name"]: (j["completed_key"], j["newest_key"], j["failed"], j["interrupted"])
        for j in jobs
    } == {
        "demo_dag.load": ("2026-10-01", "2026-10-03", 1, 1),
        "shared.reconcile": ("2026-10-01", "2026-10-01", 0, 0),
        HOSTILE_JOB: (HOSTILE_KEY, HOSTILE_KEY, 0, 0),
    }
    calendar_href = 'href="/calendar?job=demo_dag.load"'
    assert calendar_href in client.get("/").text
    assert calendar_href in client.get("/dags/demo_dag").text
    assert calendar_href in client.get("/keys", job="demo_dag.load", run_key="2026-10-01").text
    assert client.get("/api/calendar", job="secret_dag.pay").status_code == 404
    assert client.get("/api/calendar", job="script.job").status_code == 404
    assert (
        Client(auth_manager, "viewer").json("/api/calendar", job="script.job")["calendar"]["period"]
        == "day"
    )
    odd = client.get("/calendar", job=HOSTILE_JOB)
    assert odd.status_code == 200 and 'id="no-calendar"' in odd.text
    assert "<script>alert(2)" not in odd.text and "<img src=x" not in odd.text


@pytest.mark.parametrize(
    ("params", "status", "says"),
    [
        ({"job": "no.such.job"}, 404, "Job 'no.such.job' is not recorded"),
        ({}, 400, "job: required"),
        ({"job": "demo_dag.load", "from": "2026-13-01", "to": "2026-12-01"}, 400, "not a real day"),
        ({"job": "demo_dag.load", "from": "2026-10", "to": "2026-11"}, 400, "YYYY-MM-DD"),
        ({"job": "demo_dag.load", "from": "2026-10-05", "to": "2026-10-01"}, 400, "comes after"),
        (
            {"job": "demo_dag.load", "from": "2020-01-01", "to": "2026-10-01"},
            400,
            "narrow the range",
        ),
        ({"job": "demo_dag.load", "from": "2026-10-01"}, 400, "both from and to"),
    ],
    ids=["unknown-job", "no-job", "not-a-day", "other-period", "reversed", "too-long", "one-end"],
)
def test_calendar_refuses_bad_input_clearly(
    auth_manager: Any, seeded: str, params: dict[str, str], status: int, says: str
) -> None:
    """An unknown job is a 404; a malformed, reversed, too long or half range a 400 saying
    what was wrong: as JSON, and as a page (never a stack trace)."""
    client = Client(auth_manager, "viewer")
    response = client.get("/api/calendar", **params)
    assert response.status_code == status, response.text
    assert says in json.dumps(response.json()["detail"])
    page = client.get("/calendar", **params)
    assert page.status_code == status
    if params:
        assert says.replace("'", "&#39;") in page.text and "Traceback" not in page.text


def test_locks_page_names_each_holder_and_its_age(auth_manager: Any, seeded: str) -> None:
    """The locks held now, each with its worker's host and pid, attempt, DAG run, task and
    age; a user barred from a DAG does not see that DAG's locks."""
    with (
        key_held(seeded, "demo_dag.load", "2026-10-07", scheduled("r7")),
        key_held(seeded, "secret_dag.pay", "2026-10-02", scheduled("s2", dag_id="secret_dag")),
    ):
        locks = Client(auth_manager, "viewer").json("/api/locks")["locks"]
        page = Client(auth_manager, "viewer").get("/locks").text
        barred = Client(auth_manager, "restricted").json("/api/locks")["locks"]
        barred_page = Client(auth_manager, "restricted").get("/locks").text
        with psycopg.connect(seeded) as conn:
            ((attempt_id, pid),) = conn.execute(
                "SELECT attempt_id, pid FROM idempotency.job_run_attempts"
                " WHERE run_key = '2026-10-07' AND outcome = 'running'"
            ).fetchall()
    assert [(lock["job_name"], lock["run_key"]) for lock in locks] == [
        ("demo_dag.load", "2026-10-07"), ("secret_dag.pay", "2026-10-02"),
    ]  # fmt: skip
    lock = locks[0]
    assert (lock["run_id"], lock["task_id"], lock["dag_id"]) == ("r7", "t", "demo_dag")
    assert (lock["attempt_id"], lock["worker_pid"]) == (attempt_id, pid)
    assert lock["worker_host"] and 0 <= lock["age"] < 120
    assert f"#{attempt_id}" in page and f"{lock['worker_host']}:{pid}" in page
    assert [(b["job_name"], b["run_key"]) for b in barred] == [("demo_dag.load", "2026-10-07")]
    assert "secret_dag" not in barred_page
    assert Client(auth_manager, "viewer").json("/api/locks")["locks"] == []
    assert 'id="no-locks"' in Client(auth_manager, "viewer").get("/locks").text


def test_a_lease_is_shown_as_a_lock_held_on_every_page(auth_manager: Any, seeded: str) -> None:
    """A run of the lease mode working now: its key is running (not interrupted) in the
    overview and the calendar, listed among the locks with its lease (token, expiry), and its
    key's page names the lease."""
    with key_held(seeded, "demo_dag.load", "2026-10-08", scheduled("r8"), lock_mode="lease"):
        client = Client(auth_manager, "viewer")
        locks = client.json("/api/locks")["locks"]
        page = client.get("/locks").text
        overview = client.get("/").text
        key_page = client.get("/keys", job="demo_dag.load", run_key="2026-10-08").text
        key = client.json("/api/keys", job="demo_dag.load", run_key="2026-10-08")["key"]
        ((token,),) = rows(seeded, "SELECT token FROM idempotency.run_leases")
    (lock,) = locks
    assert (lock["run_key"], lock["lock_mode"], lock["lease_token"]) == (
        "2026-10-08",
        "lease",
        token,
    )
    assert f"lease token {token} of " in page and f"lease token {token}," in overview
    assert "Lease held now" in key_page and f"token {token} of " in key_page
    assert key["run"]["state"] == "running" and key["lease"]["live"]


def test_overview_totals_unconfirmed_effects_per_remote_system(
    auth_manager: Any, seeded: str
) -> None:
    """The overview sums the pending and failed effects of every key the user may read, per
    remote system; a user barred from a DAG gets totals without that DAG's effects."""
    add_effects(seeded, "demo_dag.load", "2026-10-02", pending=2)
    with psycopg.connect(seeded, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO idempotency.outbound_ledger (remote_system, idempotency_key, job_name,"
            " run_key, request_fingerprint, status) VALUES"
            " ('warehouse', 'w1', 'demo_dag.load', '2026-10-01', 'f', 'failed'),"
            " ('warehouse', 'w2', 'demo_dag.load', '2026-10-01', 'f', 'succeeded')"
        )

    def totals(user: str, role: str = "viewer") -> dict[str, tuple[int, int, int]]:
        client = Client(auth_manager, user, role)
        remotes = client.json("/api/overview")["overview"]["remotes"]
        page = client.get("/").text
        for r in remotes:  # the page shows the same figures
            row = re.search(rf'<tr data-remote="{r["remote_system"]}">(.*?)</tr>', page, re.S)
            assert row and f'pending">{r["pending"]}<' in row.group(1)
        return {r["remote_system"]: (r["pending"], r["failed"], r["run_keys"]) for r in remotes}

    # accounting: demo_dag.load 10-01 (1 pending, 1 failed), 10-02 (2 pending),
    # secret_dag.pay 10-01 (3 pending); warehouse: one failed.
    assert totals("admin", "admin") == {"accounting": (6, 1, 3), "warehouse": (0, 1, 1)}
    assert totals("restricted") == {"accounting": (3, 1, 2), "warehouse": (0, 1, 1)}


def inline_handlers_or_styles(page: str) -> list[str]:
    """The attributes of the page's tags that a strict CSP would block (on*, style)."""
    from html.parser import HTMLParser

    found: list[str] = []

    class Attributes(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            found.extend(
                f"{tag}.{name}" for name, _ in attrs if name.startswith("on") or name == "style"
            )

    Attributes().feed(page)
    return found


def test_pages_and_json_carry_security_headers(auth_manager: Any, seeded: str) -> None:
    """Each page has a CSP whose nonce is the one of its only inline style and script (no
    inline handler or style attribute), may be framed by Airflow's own origin only, and each
    JSON answer and error page carries the headers too."""
    client = Client(auth_manager, "user", "user")
    for path, params in (
        ("/", {}),
        ("/dags/demo_dag", {}),
        ("/keys", {"job": "demo_dag.load", "run_key": "2026-10-02"}),
        ("/calendar", {"job": "demo_dag.load"}),
        ("/locks", {}),
        ("/keys", {"job": "no.such", "run_key": "x"}),
    ):
        response = client.get(path, **params)
        policy = response.headers["content-security-policy"]
        (nonce,) = re.findall(r"script-src 'nonce-([^']+)'", policy)
        assert f"style-src 'nonce-{nonce}'" in policy and "frame-ancestors 'self'" in policy
        assert "unsafe-inline" not in policy and "default-src 'none'" in policy
        assert response.headers["x-frame-options"] == "SAMEORIGIN"
        assert response.text.count("<script") == response.text.count(f'<script nonce="{nonce}">')
        assert response.text.count("<style") == response.text.count(f'<style nonce="{nonce}">')
        assert response.text.count("<script") == 1
        assert not inline_handlers_or_styles(response.text), path
    again = client.get("/").headers["content-security-policy"]
    assert again != client.get("/").headers["content-security-policy"]  # a nonce per response
    for answer in (client.get("/api/overview"), client.get("/api/calendar")):
        assert "frame-ancestors 'self'" in answer.headers["content-security-policy"]
        assert answer.headers["x-content-type-options"] == "nosniff"


def test_rerun_form_asks_before_it_triggers(auth_manager: Any, seeded: str) -> None:
    """The rerun form's button only opens a confirmation that names the DAG and the key (the
    script fills in Force and Dry run); the POST is wired to its "Yes, trigger" button."""
    page = Client(auth_manager, "user", "user").get(
        "/keys", job="demo_dag.load", run_key="2026-10-02"
    )
    form = re.search(r'<form class="rerun"(.*?)</form>', page.text, re.S)
    assert form is not None
    assert 'data-dag-id="demo_dag"' in form.group(1) and 'data-run-key="2026-10-02"' in form.group(
        1
    )
    assert '<div class="confirm" role="alertdialog" hidden>' in form.group(1)
    assert 'class="yes primary">Yes, trigger</button>' in form.group(1)
    script = page.text[page.text.index("<script") :]
    assert 'form.addEventListener("submit", (event) => { event.preventDefault(); ask(); });' in (
        script
    )
    assert script.index('querySelector("button.yes").addEventListener("click", async') < (
        script.index("await fetch(form.dataset.api")
    )


def view_pids(dsn: str) -> set[int]:
    """The backends of the view's pool on this database (its application_name)."""
    return {
        int(pid)
        for (pid,) in rows(
            dsn,
            "SELECT pid FROM pg_stat_activity"
            " WHERE application_name = 'airflow-idempotency ui' AND datname = current_database()",
        )
    }


def test_job_database_connections_are_a_bounded_pool(
    auth_manager: Any, seeded: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many pages at once share at most [idempotency] ui_pool_size connections (the others
    wait for one), later pages reuse them, and an edited Airflow connection gets a new pool
    (the old sessions end)."""
    import concurrent.futures
    import time

    from airflow_idempotency.ui.settings import Settings

    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__UI_POOL_SIZE", "2")
    settings = Settings.from_airflow_config()
    assert settings.pool_size == 2
    POOLS.close()
    client = Client(auth_manager, "viewer", settings=settings)
    seen: list[int] = []

    def page(_: int) -> int:
        seen.append(len(view_pids(seeded)))
        return int(client.get("/api/overview").status_code)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(page, range(40)))
    assert statuses == [200] * 40
    sessions = view_pids(seeded)
    assert 1 <= len(sessions) <= 2 and max(seen) <= 2
    for _ in range(5):
        client.json("/api/locks")
    assert view_pids(seeded) == sessions  # reused, not reopened
    # An edited connection (here its application_name) gets a new pool; the old one's
    # sessions end.
    edited = {**json.loads(airflow_env.airflow_connection_json(seeded)), "extra": {}}
    edited["extra"] = {"application_name": "edited"}
    monkeypatch.setenv("AIRFLOW_CONN_IDEMPOTENCY_DEFAULT", json.dumps(edited))
    assert client.json("/api/overview")["overview"]["counts"]["failed"] == 1
    deadline = time.monotonic() + 10
    while view_pids(seeded) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert view_pids(seeded) == set()
    POOLS.close()


def test_pool_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool size below 1 or a non-positive timeout is refused, naming the setting."""
    from airflow_idempotency.exceptions import InvalidInputError
    from airflow_idempotency.ui.settings import Settings

    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__UI_POOL_SIZE", "0")
    with pytest.raises(InvalidInputError, match=r"ui_pool_size must be at least 1"):
        Settings.from_airflow_config()
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__UI_POOL_SIZE", "3")
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__UI_POOL_TIMEOUT", "0")
    with pytest.raises(InvalidInputError, match=r"ui_pool_timeout must be a positive"):
        Settings.from_airflow_config()


def test_unknown_effects_of_every_kind_come_first(auth_manager: Any, seeded: str) -> None:
    """An email left unknown shows first among the overview's unconfirmed effects, with its kind, and on its key's page, with what to do about it; a later resolution is shown there (who, when)."""
    rows(
        seeded,
        "INSERT INTO idempotency.outbound_ledger (remote_system, idempotency_key, job_name,"
        " run_key, request_fingerprint, status, effect_kind, deduplicating, updated_at)"
        " VALUES ('finance_mail', 'mail:1', 'demo_dag.load', '2026-10-03', 'f', 'unknown',"
        " 'email', false, now() - interval '1 day')",
    )
    client = Client(auth_manager, "viewer")
    unconfirmed = client.json("/api/overview")["overview"]["unconfirmed"]
    assert (unconfirmed[0]["remote_system"], unconfirmed[0]["kinds"], unconfirmed[0]["unknown"]) == (
        "finance_mail", "email", 1,
    )  # fmt: skip
    page = client.get("/", job="demo_dag.load")
    assert page.status_code == 200 and "ledger-unknown" in page.text
    key_page = client.get("/keys", job="demo_dag.load", run_key="2026-10-03")
    assert "mark-sent" in key_page.text and "email" in key_page.text
    from airflow_idempotency.effects.resolutions import resolve_unknown

    with psycopg.connect(seeded, autocommit=True) as conn:
        resolve_unknown(conn, "idempotency", remote_system="finance_mail", idempotency_key="mail:1",
                        action="resend", resolved_by="ann", reason="not in the mailbox")  # fmt: skip
    detail = client.json("/api/keys", job="demo_dag.load", run_key="2026-10-03")["key"]
    [effect] = [u for u in detail["unconfirmed"] if u["idempotency_key"] == "mail:1"]
    assert (effect["status"], effect["last_resolution"], effect["resolved_by"]) == (
        "pending", "resend", "ann",
    )  # fmt: skip


LONG = "k" * 401
# (path, parameters, what the 400's message says): each malformed parameter of every page.
REFUSED = [
    ("/keys", {"job": "demo_dag.load", "run_key": "2026-10-01\x00"}, "run_key: holds U+0000"),
    ("/keys", {"job": "demo\x1bload", "run_key": "2026-10-01"}, "job: holds U+001B"),
    ("/keys", {"job": "demo_dag.load", "run_key": LONG}, "run_key: longer than 400"),
    ("/keys", {"job": "", "run_key": "2026-10-01"}, "job: empty"),
    ("/keys", {"job": "demo_dag.load"}, "run_key: required"),
    ("/keys", {"job": "demo_dag.load", "run_key": "2026-10-01", "runkey": "x"}, "runkey: not a"),
    ("/", {"status": "done"}, "status: must be one of completed, failed, started"),
    ("/", {"from": "2026-10-05", "to": "2026-10-01"}, "swap them"),
    ("/", {"before_key": "2026-10-01"}, "before_key and before_job go together"),
    ("/", {"job": "\x00"}, "job: holds U+0000"),
    ("/", {"limit": "-1"}, "limit: not a parameter of this page; it takes before_job"),
    ("/calendar", {"job": "demo_dag.load", "from": "2026-10-01\x00", "to": "x"}, "from: holds"),
    ("/calendar", {"job": "demo_dag.load", "segment": LONG}, "segment: longer than 400"),
    ("/dags/demo_dag", {"before_key": "\x7f"}, "before_key: holds U+007F"),
    ("/dags/demo_dag", {"page": "2"}, "page: not a parameter"),
    ("/dags/demo%00dag", {}, "dag_id: holds U+0000"),
    ("/dags/demo_dag/runs/r1%00", {}, "run_id: holds U+0000"),
    ("/dags/demo_dag/runs/r1", {"task_id": "t\x00"}, "task_id: holds U+0000"),
    ("/dags/" + LONG, {}, "dag_id: longer than 400"),
    # An unknown parameter of the page without parameters; a parameter sent twice (the
    # 3.x line took the last, Flask's to_dict the first: two lines, two answers).
    ("/locks", {"foo": "1"}, "foo: not a parameter of this page; it takes none"),
    ("/", {"job": ["a", "b"]}, "job: sent 2 times; send it once"),
    ("/", {"status": ["failed", "completed"]}, "status: sent 2 times; send it once"),
    ("/keys", {"job": "demo_dag.load", "run_key": ["x", "2026-10-01"]}, "run_key: sent 2 times"),
]


def table_counts(dsn: str) -> dict[str, int]:
    tables = ("job_runs", "job_run_attempts", "outbound_ledger")
    return {t: rows(dsn, f"SELECT count(*) FROM idempotency.{t}")[0][0] for t in tables}


@pytest.mark.parametrize(("path", "params", "says"), REFUSED, ids=[r[2][:24] for r in REFUSED])
def test_every_malformed_parameter_is_a_400_that_says_what_to_do(
    auth_manager: Any, seeded: str, path: str, params: dict[str, Any], says: str
) -> None:
    """A NUL byte or another control character, an over-long or empty value, a missing or
    unknown parameter, a status that is none, a reversed range, half a page marker, in the
    query or the path, of every page: a 400 naming the parameter and what to send, as JSON
    and as the page, never a 500 (PostgreSQL refuses a NUL), and the records are unchanged."""
    client = Client(auth_manager, "admin", "admin")
    before = table_counts(seeded)
    api = "/api" + (path if path != "/" else "/overview")
    answer = client.get(api, **params)
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert says in body["detail"], body
    assert body["errors"] and all(e["loc"][0] in ("query", "path") for e in body["errors"])
    page = client.get(path, **params)
    assert page.status_code == 400 and "Traceback" not in page.text
    assert says.replace("'", "&#39;") in page.text
    assert table_counts(seeded) == before


def test_the_api_describes_itself_honestly(auth_manager: Any) -> None:
    """``/api/openapi.json`` lists every JSON twin (and no HTML page) with each parameter's
    limits, and the answers a refusal gets (400, not FastAPI's unused 422)."""
    schema = Client(auth_manager, None).json("/api/openapi.json")
    assert sorted(schema["paths"]) == [
        "/api/calendar",
        "/api/dags/{dag_id}",
        "/api/dags/{dag_id}/runs/{run_id}",
        "/api/keys",
        "/api/locks",
        "/api/overview",
    ]
    keys = schema["paths"]["/api/keys"]["get"]
    params = {p["name"]: p for p in keys["parameters"]}
    assert params["job"]["required"] and params["job"]["schema"]["maxLength"] == 400
    assert params["run_key"]["schema"]["pattern"].startswith("^[^\\x00")
    assert sorted(keys["responses"]) == ["200", "400", "401", "403", "404", "503"]
    (dag_id,) = schema["paths"]["/api/dags/{dag_id}"]["get"]["parameters"][:1]
    assert dag_id["in"] == "path" and dag_id["schema"]["maxLength"] == 400
    overview = schema["paths"]["/api/overview"]["get"]["parameters"]
    status = next(p for p in overview if p["name"] == "status")
    assert status["schema"]["enum"] == ["completed", "failed", "started"]


def test_each_rerun_button_sends_exactly_the_key_and_options_it_shows(
    auth_manager: Any, seeded: str
) -> None:
    """In Chromium, the DAG tab's page as the app serves it (its own script, its CSP): each
    key's "Rerun…" button, with each combination of Force and Dry run, first asks a question
    naming that key and those options, and "Yes, trigger" POSTs to that DAG's dagRuns exactly
    ``{"run_key": <the key shown>}`` plus ``force`` / ``dry_run`` when ticked (the hostile key
    too, byte for byte); Cancel sends nothing."""
    from urllib.parse import urlsplit

    from support.browser import chromium, new_page

    client = Client(auth_manager, "user", "user")
    sent: list[tuple[str, dict[str, Any]]] = []

    def serve(route: Any) -> None:
        url = urlsplit(route.request.url)
        if route.request.method == "POST":
            sent.append((url.path, json.loads(route.request.post_data)))
            answer = {"dag_run_id": f"manual__{len(sent)}", "state": "queued"}
            route.fulfill(status=200, content_type="application/json", body=json.dumps(answer))
            return
        got = client.http.get(url.path + (f"?{url.query}" if url.query else ""))
        route.fulfill(status=got.status_code, headers=dict(got.headers), body=got.content)

    combos = [(False, False), (True, False), (False, True), (True, True)]
    with chromium() as browser:
        page = new_page(browser)
        page.route("http://view.test/**", serve)
        page.goto("http://view.test/dags/demo_dag")
        buttons = page.locator("button.show-rerun")
        keys = [buttons.nth(i).get_attribute("data-key") for i in range(buttons.count())]
        assert {"2026-10-01", "2026-10-02", HOSTILE_KEY} <= set(keys), keys
        for n, key in enumerate(keys):
            force, dry_run = combos[n % len(combos)]
            buttons.nth(n).click()
            form = page.locator("form.rerun").nth(n)
            assert form.get_attribute("data-run-key") == key and form.is_visible()
            form.locator("input[name=force]").set_checked(force)
            form.locator("input[name=dry_run]").set_checked(dry_run)
            form.locator("button[type=submit]").click()
            question = form.locator(".question").inner_text()
            assert f"for run key {key}," in question
            assert ("Force ticked" in question) is force
            assert ("Dry run ticked" in question) is dry_run
            before = len(sent)
            form.locator("button.no").click()
            assert len(sent) == before  # Cancel sends nothing
            form.locator("button[type=submit]").click()
            form.locator("button.yes").click()
            form.locator(".result a").wait_for()
            path, body = sent[-1]
            assert len(sent) == before + 1
            assert path == "/api/v2/dags/demo_dag/dagRuns"
            expected = {"run_key": key} | ({"force": True} if force else {})
            expected |= {"dry_run": True} if dry_run else {}
            assert body["conf"] == expected, (key, force, dry_run, body)
            assert key in body["note"]
        page.context.close()


@pytest.mark.parametrize("path", ["/api/dags/demo_dag/runs/.", "/api/dags/..", "/api/dags/."])
def test_a_dot_path_parameter_is_a_json_404(auth_manager: Any, path: str) -> None:
    """A DAG or run id of ``.`` or ``..`` that a client sends unencoded: the URL's dot
    segments are removed before the view sees it, so the answer is a 404 as the schema
    documents it (JSON), never an undocumented 307 redirect or an HTML page under /api
    (what schemathesis draws now and then from the path parameters' pattern)."""
    answer = Client(auth_manager, "admin", "admin").get(path)
    assert answer.status_code == 404, (answer.status_code, answer.headers, answer.text[:300])
    assert answer.headers["content-type"] == "application/json", answer.text[:300]
    assert answer.json()["detail"]
