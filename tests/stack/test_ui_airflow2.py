"""The Run keys view on Airflow 2.11: the Flask AppBuilder view of a real webserver (FAB's
login and permissions), with a real scheduler running the DAGs and the reruns, through HTTP
and in a browser.

One webserver and one scheduler for the module (SQLite metadata, SequentialExecutor), DAGs
from tests/dags_ui. Users: ``admin`` (Admin), ``viewer`` (Viewer), ``operator`` (User: may
trigger), ``limited`` (a role of its own: Viewer's permissions without "read on DAGs", plus
"read on DAG:ui_demo"). Screenshots go to ``$IDEMPOTENCY_UI_SCREENSHOTS`` when set (the
docs' come from there), else to the test's temporary folder.
"""

from __future__ import annotations

import base64
import http.cookiejar
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools import airflow_env
from devtools.airflow_stack import free_port
from devtools.workers import kill_group, start_airflow
from support import TESTS
from support.browser import follow, new_page
from support.db import rows

pytestmark = [pytest.mark.airflow2_only, pytest.mark.slow]

DAGS = TESTS / "dags_ui"
USERS = {"admin": "Admin", "viewer": "Viewer", "operator": "User", "limited": "Limited"}

SET_UP = """
import json, sys
from airflow.models.dagbag import DagBag
from airflow.www.app import cached_app

DagBag().sync_to_db()  # what `airflow dags reserialize` does
security = cached_app().appbuilder.sm
security.sync_roles()  # `airflow sync-perm`: the default roles
security.create_dag_specific_permissions()  # DAG:<dag_id>
role = security.add_role("Limited")
for permission in security.find_role("Viewer").permissions:
    if permission.resource.name != "DAGs":
        security.add_permission_to_role(role, permission)
security.add_permission_to_role(role, security.create_permission("can_read", "DAG:ui_demo"))
for name, role_name in json.loads(sys.argv[1]).items():
    found = security.find_role(role_name)
    assert security.add_user(name, name, "test", name + "@example.com", found, name), name
"""
"""One process for what `airflow dags reserialize`, `sync-perm` and `users create` would do
in six (each CLI call costs ~10 s of imports on a loaded machine)."""


class Webserver2:
    """Airflow 2.11's webserver and scheduler on one home, and HTTP as its users."""

    def __init__(self, home: Path, job_dsn: str) -> None:
        self.home = home
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ)
        airflow_env.configure(home, self.env, airflow2=True)
        self.env.update(
            {
                "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
                **airflow_env.connection_env(job_dsn),
                "AIRFLOW__WEBSERVER__WEB_SERVER_PORT": str(self.port),
                "AIRFLOW__WEBSERVER__WORKERS": "1",
                "AIRFLOW__WEBSERVER__BASE_URL": self.base_url,
                "AIRFLOW__WEBSERVER__SECRET_KEY": "idempotency-test-secret",
                "AIRFLOW__WEBSERVER__WARN_DEPLOYMENT_EXPOSURE": "False",
                # FAB limits logins to 5 in 40 s per client; the tests sign in more often.
                "AIRFLOW__WEBSERVER__AUTH_RATE_LIMITED": "False",
                "AIRFLOW__API__AUTH_BACKENDS": (
                    "airflow.api.auth.backend.basic_auth,airflow.api.auth.backend.session"
                ),
                "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
                "AIRFLOW__SCHEDULER__DAG_DIR_LIST_INTERVAL": "5",
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                "PYTHONPATH": os.pathsep.join(
                    [str(airflow_env.ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]
                ),
            }
        )
        self.procs: list[subprocess.Popen[str]] = []
        self.sessions: dict[str, Session] = {}

    def airflow(self, *args: str, stdin: str | None = None) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "airflow", *args],
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-3000:])
        return proc.stdout

    def start(self) -> None:
        self.airflow("db", "migrate")
        subprocess.run(
            [sys.executable, "-c", SET_UP, json.dumps(USERS)], env=self.env, check=True,
            timeout=300, capture_output=True,
        )  # fmt: skip
        logs = self.home / "logs-stack"
        logs.mkdir(exist_ok=True)
        for name in ("webserver", "scheduler"):
            out = open(logs / f"{name}.log", "w")  # noqa: SIM115 - the process keeps it
            self.procs.append(start_airflow(self.env, name, output=out))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise AssertionError("webserver did not start: " + self.log("webserver"))

    def log(self, name: str) -> str:
        path = self.home / "logs-stack" / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs:
            kill_group(proc)

    # -- HTTP ------------------------------------------------------------------------------

    def session(self, user: str | None) -> Session:
        """A cookie session, signed in as ``user`` through FAB's login form (once per user;
        None: anonymous)."""
        if user is None:
            return Session(self.base_url)
        if user not in self.sessions:
            self.sessions[user] = Session(self.base_url)
            self.sessions[user].login(user)
        return self.sessions[user]

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """The stable REST API as admin (basic auth)."""
        token = base64.b64encode(b"admin:admin").decode()
        request = urllib.request.Request(
            f"{self.base_url}/api/v1{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Content-Type": "application/json", "Authorization": f"Basic {token}"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        return str(self.api("POST", f"/dags/{dag_id}/dagRuns", {"conf": conf})["dag_run_id"])

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        quoted = urllib.parse.quote(run_id, safe="")
        while time.monotonic() < deadline:
            state = self.api("GET", f"/dags/{dag_id}/dagRuns/{quoted}")["state"]
            if state in ("success", "failed"):
                return str(state)
            time.sleep(1)
        raise AssertionError(f"{dag_id} {run_id} did not finish:\n{self.log('scheduler')}")


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class Session:
    """HTTP with a cookie jar (FAB's session cookie), redirects not followed."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(
            NoRedirect, urllib.request.HTTPCookieProcessor(self.jar)
        )

    def get(self, path: str, **params: str) -> tuple[int, Any, dict[str, str]]:
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        return self.request("GET", path + query)

    def request(
        self,
        method: str,
        path: str,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, dict[str, str]]:
        request = urllib.request.Request(
            f"{self.base_url}{path}", data=data, method=method, headers=headers or {}
        )
        try:
            with self.opener.open(request, timeout=60) as response:
                status, payload, got = response.status, response.read(), dict(response.headers)
        except urllib.error.HTTPError as exc:
            status, payload, got = exc.code, exc.read(), dict(exc.headers)
        text = payload.decode(errors="replace")
        got = {k.lower(): v for k, v in got.items()}
        if got.get("content-type", "").startswith("application/json"):
            return status, json.loads(text), got
        return status, text, got

    def login(self, user: str) -> None:
        status, form, _ = self.get("/login/")
        assert status == 200, form[:500]
        (token,) = re.findall(r'name="csrf_token"[^>]*value="([^"]+)"', form)
        body = urllib.parse.urlencode({"username": user, "password": user, "csrf_token": token})
        status, _, headers = self.request(
            "POST",
            "/login/",
            body.encode(),
            {"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert status == 302 and "/login" not in headers["location"], (status, headers)


@pytest.fixture(scope="module")
def webserver(job_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webserver2]:
    server = Webserver2(tmp_path_factory.mktemp("ui-airflow2") / "home", job_dsn)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def runs(webserver: Webserver2) -> dict[str, str]:
    """ui_demo and ui_secret run for 2026-10-01 (their run ids); ui_demo's load of
    2026-10-02 fails."""
    done = {}
    for dag_id in ("ui_demo", "ui_secret"):
        run_id = webserver.trigger(dag_id, {"run_key": "2026-10-01"})
        assert webserver.wait_for_run(dag_id, run_id) == "success"
        done[dag_id] = run_id
    failing = webserver.trigger("ui_demo", {"run_key": "2026-10-02"})
    assert webserver.wait_for_run("ui_demo", failing) == "failed"
    return done


JSON_PATHS = (
    "/runkeys/api/overview",
    "/runkeys/api/dags/ui_demo",
    "/runkeys/api/dags/ui_demo/runs/x",
    "/runkeys/api/keys?job=ui_demo.load&run_key=2026-10-01",
    "/runkeys/api/calendar?job=ui_demo.load",
    "/runkeys/api/locks",
)


def test_fab_login_guards_every_page_and_json(webserver: Webserver2, runs: dict[str, str]) -> None:
    """Without a session each page redirects to FAB's login (and back) and each JSON
    endpoint answers 401; signed in, the menu has "Run keys" and the page frames the view's
    own document, which carries the strict CSP."""
    anonymous = webserver.session(None)
    for path in JSON_PATHS:
        status, body, _ = anonymous.request("GET", path)
        assert status == 401, (path, body)
    status, _, headers = anonymous.get("/runkeys/keys", job="ui_demo.load", run_key="2026-10-01")
    assert status == 302 and "/login/?next=" in headers["location"]
    assert "/runkeys/keys?job=ui_demo.load" in urllib.parse.unquote(headers["location"])

    viewer = webserver.session("viewer")
    status, home, _ = viewer.get("/home")
    assert status == 200 and 'href="/runkeys/"' in home  # the main menu's entry
    status, outer, _ = viewer.get("/runkeys/keys", job="ui_demo.load", run_key="2026-10-01")
    assert status == 200
    assert 'src="/runkeys/page/keys?job=ui_demo.load&amp;run_key=2026-10-01"' in outer
    status, page, headers = viewer.get(
        "/runkeys/page/keys", job="ui_demo.load", run_key="2026-10-01"
    )
    assert status == 200 and "2026-10-01" in page
    (nonce,) = re.findall(r"script-src 'nonce-([^']+)'", headers["content-security-policy"])
    assert (
        f'<script nonce="{nonce}">' in page
        and "frame-ancestors 'self'" in headers["content-security-policy"]
    )


def test_fab_permissions_decide_what_each_user_sees(
    webserver: Webserver2, runs: dict[str, str]
) -> None:
    """A Viewer reads every DAG's records but gets no rerun button; a user whose role may
    read only ui_demo gets none of ui_secret's records, its pages are 403 and its keys 404;
    a user who may trigger gets the rerun form, posting to the stable REST API with the
    CSRF token."""
    viewer = webserver.session("viewer")
    status, data, _ = viewer.get("/runkeys/api/overview")
    assert status == 200
    jobs = {r["job_name"] for r in data["overview"]["runs"]}
    assert jobs == {"ui_demo.extract", "ui_demo.load", "ui_secret.pay"}
    status, page, _ = viewer.get("/runkeys/page/keys", job="ui_demo.load", run_key="2026-10-02")
    assert status == 200 and 'class="rerun"' not in page

    limited = webserver.session("limited")
    status, data, _ = limited.get("/runkeys/api/overview")
    assert {r["job_name"] for r in data["overview"]["runs"]} == {"ui_demo.extract", "ui_demo.load"}
    assert limited.get("/runkeys/page/dags/ui_secret")[0] == 403
    assert limited.get("/runkeys/api/dags/ui_secret")[0] == 403
    status, body, _ = limited.get("/runkeys/api/keys", job="ui_secret.pay", run_key="2026-10-01")
    assert status == 404 and "is not recorded" in body["detail"]
    status, page, _ = limited.get("/runkeys/page/")
    assert "ui_secret" not in page and "ui_demo.load" in page

    operator = webserver.session("operator")
    status, page, _ = operator.get("/runkeys/page/keys", job="ui_demo.load", run_key="2026-10-02")
    form = re.search(r'<form class="rerun"([^>]*)>', page)
    assert form is not None
    assert 'data-api="/api/v1/dags/ui_demo/dagRuns"' in form.group(1)
    assert re.search(r'data-csrf="[^"]{20,}"', form.group(1))
    assert "data-no-logical-date" not in form.group(1)


def test_fab_webserver_answers_404_and_400(webserver: Webserver2, runs: dict[str, str]) -> None:
    """An unknown key is a 404 and a malformed calendar range or a missing job a 400 saying
    what was wrong, as JSON and as the page."""
    viewer = webserver.session("viewer")
    status, body, _ = viewer.get("/runkeys/api/keys", job="ui_demo.load", run_key="1999-01-01")
    assert status == 404 and "is not recorded" in body["detail"]
    status, page, _ = viewer.get("/runkeys/page/keys", job="ui_demo.load", run_key="1999-01-01")
    assert status == 404 and "is not recorded" in page
    status, body, _ = viewer.get(
        "/runkeys/api/calendar", job="ui_demo.load", **{"from": "2026-10-05", "to": "2026-10-01"}
    )
    assert status == 400 and "comes after" in body["detail"]
    status, body, _ = viewer.get("/runkeys/api/calendar")
    assert status == 400 and body["errors"][0]["loc"] == ["query", "job"]
    assert "job: required" in body["detail"]
    status, page, _ = viewer.get("/runkeys/page/calendar")
    assert status == 400 and "job: required" in page


def test_fab_extra_link_opens_the_key_of_the_task(
    webserver: Webserver2, runs: dict[str, str]
) -> None:
    """The task instance's "Run key" link (the webserver deserializes the DAG with the
    plugin's link class) leads to the key the task recorded."""
    run_id = urllib.parse.quote(runs["ui_demo"], safe="")
    links = webserver.api("GET", f"/dags/ui_demo/dagRuns/{run_id}/taskInstances/extract/links")
    link = links["Run key"]
    assert link.startswith("/runkeys/task?dag_id=ui_demo&")
    status, _, headers = webserver.session("viewer").request("GET", link)
    assert status == 302
    assert headers["location"].endswith("/runkeys/keys?job=ui_demo.extract&run_key=2026-10-01")


def test_fab_key_page_shows_each_attempts_provenance(
    webserver: Webserver2, runs: dict[str, str]
) -> None:
    """A triggered run, then cleared through Airflow's REST API and run again by the
    scheduler: the key's attempts show the run type and, for the rerun, the clear number
    Airflow recorded (1); Airflow 2 task instances have no id and DAGs no versions, so
    neither is shown, and no triggering user is recorded."""
    run_id = runs["ui_demo"]
    quoted = urllib.parse.quote(run_id, safe="")
    webserver.api("POST", f"/dags/ui_demo/dagRuns/{quoted}/clear", {"dry_run": False})
    assert webserver.wait_for_run("ui_demo", run_id) == "success"
    viewer = webserver.session("viewer")
    status, data, _ = viewer.get("/runkeys/api/keys", job="ui_demo.load", run_key="2026-10-01")
    assert status == 200
    seen = [
        (a["outcome"], a["run_id"], a["run_type"], a["clear_number"], a["ti_id"])
        for a in data["key"]["attempts"]
        if a["run_id"] == run_id
    ]
    assert seen == [("noop", run_id, "manual", 1, None), ("completed", run_id, "manual", 0, None)]
    assert {a["triggering_user"] for a in data["key"]["attempts"]} == {None}
    status, page, _ = viewer.get("/runkeys/page/keys", job="ui_demo.load", run_key="2026-10-01")
    assert status == 200 and "<span data-run-type>manual</span>" in page
    assert ">cleared 1" in page and "data-ti-id" not in page and "data-dag-version" not in page


# ---------------------------------------------------------------- the browser


def test_in_the_browser_on_airflow2_operator_reads_and_reruns_a_key(
    browser: Any, webserver: Webserver2, runs: dict[str, str], shots: Path, job_dsn: str
) -> None:
    """Signed in through FAB's login form: "Run keys" in the menu shows the overview, a key's
    page its attempts; a rerun of the completed key, confirmed, is a new DAG run whose
    attempts are no-ops, and one with Force ticked recomputes it; a link to the DAG run opens
    Airflow's grid in the top window."""
    page = new_page(browser, height=900)
    page.goto(f"{webserver.base_url}/login/")
    page.fill("input[name=username]", "operator")
    page.fill("input[name=password]", "operator")
    page.click("input[type=submit], button[type=submit]")
    page.wait_for_url(lambda url: "/login" not in url)
    follow(page, page.get_by_role("link", name="Run keys").first, "**/runkeys/")
    frame = page.frame_locator("#run-keys-frame")
    frame.locator("table.runs").wait_for()
    assert frame.locator("table.runs tbody tr").count() == 5
    assert "the warehouse refused the load" in frame.locator("#attention + table").inner_text()
    page.screenshot(path=shots / "run-keys-airflow2-overview.png")

    frame.locator('table.runs a[href$="/keys?job=ui_demo.load&run_key=2026-10-01"]').click()
    frame.locator("#attempts").wait_for()
    page.wait_for_url("**/runkeys/keys?job=ui_demo.load&run_key=2026-10-01")  # follows the frame
    assert frame.locator("h1").inner_text().startswith("2026-10-01 of ui_demo.load")
    form = frame.locator("form.rerun")
    form.locator("button[type=submit]").click()
    question = form.locator(".confirm .question").inner_text()
    assert question.startswith("Trigger a run of DAG ui_demo for run key 2026-10-01, Force not")
    form.locator(".confirm button.yes").click()
    form.locator(".result a").wait_for()
    rerun_id = form.locator(".result a").inner_text()
    page.screenshot(path=shots / "run-keys-airflow2-key.png")
    assert webserver.wait_for_run("ui_demo", rerun_id) == "success"
    outcomes = rows(
        job_dsn,
        "SELECT job_name, outcome FROM idempotency.job_run_attempts WHERE run_id = %s"
        " ORDER BY job_name",
        (rerun_id,),
    )
    assert outcomes == [("ui_demo.extract", "noop"), ("ui_demo.load", "noop")]
    # Forced, the same key is recomputed: completed attempts that say so.
    page.reload()
    frame = page.frame_locator("#run-keys-frame")
    form = frame.locator("form.rerun")
    form.locator("input[name=force]").check()
    form.locator("button[type=submit]").click()
    assert "Force ticked" in form.locator(".confirm .question").inner_text()
    form.locator(".confirm button.yes").click()
    form.locator(".result a").wait_for()
    forced_id = form.locator(".result a").inner_text()
    assert webserver.wait_for_run("ui_demo", forced_id) == "success"
    forced = rows(
        job_dsn,
        "SELECT job_name, outcome, force FROM idempotency.job_run_attempts"
        " WHERE run_id = %s ORDER BY job_name",
        (forced_id,),
    )
    assert forced == [("ui_demo.extract", "completed", True), ("ui_demo.load", "completed", True)]
    # A link to the DAG run opens Airflow's own grid, in the top window.
    page.reload()
    frame = page.frame_locator("#run-keys-frame")
    frame.locator("#record a[data-airflow]").first.click()
    page.wait_for_url("**/dags/ui_demo/grid?dag_run_id=**")
    page.context.close()
