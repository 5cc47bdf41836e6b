"""The Run keys view in a real Airflow 3 (api-server, scheduler, dag-processor), through HTTP
and in a browser: users signed in with SimpleAuthManager, one of them barred from a DAG.

One stack for the module (about a minute to start). The browser is Debian's Chromium,
driven by Playwright; screenshots go to ``$IDEMPOTENCY_UI_SCREENSHOTS`` when set (the
docs' come from there), else to the test's temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from devtools import airflow_env
from devtools.airflow_stack import AirflowStack
from support import TESTS
from support.auth_manager import DENIED_ENV
from support.browser import follow, new_page
from support.db import rows

pytestmark = pytest.mark.slow

DAGS = TESTS / "dags_ui"
USERS = {"admin": "admin", "viewer": "viewer", "restricted": "viewer", "operator": "user"}


class SignedInStack(AirflowStack):
    """The stack with real users: its REST calls are made as ``admin``, with a token."""

    token: str | None = None

    def start(self, timeout: float = 120.0) -> None:
        super().start(timeout)
        self.token = self.login("admin")

    def login(self, user: str) -> str:
        """A JWT for ``user`` from ``POST /auth/token`` (password = user name)."""
        body = json.dumps({"username": user, "password": user}).encode()
        request = urllib.request.Request(
            f"{self.base_url}/auth/token",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return str(json.load(response)["access_token"])

    def api(self, method: str, path: str, body: Any = None) -> Any:
        return self.http(method, path, body, token=self.token)[1]

    def http(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        cookie: bool = False,
    ) -> tuple[int, Any, dict[str, str]]:
        """(status, decoded JSON or text, headers) of a request, as ``token``'s user (a
        Bearer header, or the UI's ``_token`` cookie); redirects are not followed."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token and cookie:
            headers["Cookie"] = f"_token={token}"
        elif token:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(
            f"{self.base_url}{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers=headers,
        )

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args: Any, **kwargs: Any) -> None:
                return None

        opener = urllib.request.build_opener(NoRedirect)
        try:
            with opener.open(request, timeout=60) as response:
                status, payload, got = response.status, response.read(), dict(response.headers)
        except urllib.error.HTTPError as exc:
            status, payload, got = exc.code, exc.read(), dict(exc.headers)
        text = payload.decode(errors="replace")
        try:
            return status, json.loads(text), got
        except ValueError:
            return status, text, got

    def trigger_key(self, dag_id: str, run_key: str, expect: str = "success") -> str:
        """Trigger ``dag_id`` for ``run_key`` (no logical date) and wait for it; its run id."""
        run = self.api(
            "POST",
            f"/api/v2/dags/{dag_id}/dagRuns",
            {"logical_date": None, "conf": {"run_key": run_key}},
        )
        result = self.wait_for_runs(dag_id, [run["dag_run_id"]], timeout=180)[0]
        assert result.state == expect, self.describe_runs(dag_id, [result.run_id])
        return str(result.run_id)


@pytest.fixture(scope="module")
def stack(job_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SignedInStack]:
    home = tmp_path_factory.mktemp("ui-stack") / "home"
    home.mkdir()
    (home / "passwords.json").write_text(json.dumps({u: u for u in USERS}))
    extra_env = {
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{u}:{r}" for u, r in USERS.items()),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__CORE__AUTH_MANAGER": "support.auth_manager.RestrictedAuthManager",
        DENIED_ENV: json.dumps({"restricted": ["ui_secret"]}),
        **airflow_env.connection_env(job_dsn),
        "PYTHONPATH": os.pathsep.join(
            [str(airflow_env.ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]
        ),
    }
    stack = SignedInStack(home, DAGS, extra_env)
    try:
        stack.start(180)
        for dag_id in ("ui_demo", "ui_secret"):
            stack.unpause(dag_id, timeout=120)
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def runs(stack: SignedInStack) -> dict[str, str]:
    """Each DAG run once for business date 2026-10-01 (their run ids), and ui_demo for
    2026-10-02, whose load fails."""
    done = {dag_id: stack.trigger_key(dag_id, "2026-10-01") for dag_id in ("ui_demo", "ui_secret")}
    stack.trigger_key("ui_demo", "2026-10-02", expect="failed")
    return done


def test_the_api_server_serves_the_view_with_airflow_auth(
    stack: SignedInStack, runs: dict[str, str]
) -> None:
    """Mounted on the api-server: a page without a session redirects to Airflow's login, the
    UI's cookie or a Bearer token is a session, a user barred from a DAG gets none of its
    records, and Airflow lists the plugin with its three views."""
    status, _, headers = stack.http("GET", "/idempotency/")
    assert status == 303 and headers["location"].startswith("/auth/login?next=")
    viewer = stack.login("viewer")
    status, page, _ = stack.http("GET", "/idempotency/", token=viewer, cookie=True)
    assert status == 200 and "ui_demo.extract" in page and "ui_secret.pay" in page
    restricted = stack.login("restricted")
    status, data, _ = stack.http("GET", "/idempotency/api/overview", token=restricted)
    assert status == 200
    assert {r["job_name"] for r in data["overview"]["runs"]} == {"ui_demo.extract", "ui_demo.load"}
    status, _, _ = stack.http("GET", "/idempotency/dags/ui_secret", token=restricted, cookie=True)
    assert status == 403
    plugins = stack.api("GET", "/api/v2/plugins")["plugins"]
    (ours,) = [p for p in plugins if p["name"] == "idempotency"]
    assert {v["destination"] for v in ours["external_views"]} == {"nav", "dag", "dag_run"}


def test_extra_link_of_a_task_opens_its_key(stack: SignedInStack, runs: dict[str, str]) -> None:
    """The task instance's "Run key" link (computed by the worker) is the key's page inside
    Airflow's own page."""
    run_id = urllib.parse.quote(runs["ui_demo"], safe="")
    links = stack.api("GET", f"/api/v2/dags/ui_demo/dagRuns/{run_id}/taskInstances/extract/links")
    assert links["extra_links"] == {
        "Run key": "/plugin/run-keys/idempotency/keys?job=ui_demo.extract&run_key=2026-10-01"
    }


# ---------------------------------------------------------------- the browser


def signed_in(browser: Any, stack: SignedInStack, user: str) -> Any:
    """A page of a fresh browser context, signed in through Airflow's login form."""
    page = new_page(browser)
    page.goto(f"{stack.base_url}/")
    page.wait_for_url("**/auth/login**")
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", user)  # the passwords file maps each user to itself
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/auth/login" not in url)
    return page


def view(page: Any) -> Any:
    """The Run keys page inside Airflow's page (its iframe)."""
    page.wait_for_selector("iframe")
    frame = page.frame_locator("iframe").first
    frame.locator("h1").first.wait_for()
    return frame


def test_in_the_browser_operator_reads_and_reruns_a_key(
    browser: Any, stack: SignedInStack, runs: dict[str, str], shots: Path, job_dsn: str
) -> None:
    """Signed in as a user who may trigger: "Run keys" in the main navigation shows the
    records, the DAG's tab shows its keys and reruns one after a confirmation (a new run, a
    no-op), the key's page shows its attempts, and a link to the DAG run opens Airflow's own
    page, not a page in the frame."""
    page = signed_in(browser, stack, "operator")
    nav = page.get_by_role("link", name="Run keys").first
    nav.wait_for()
    assert page.locator('img[src^="data:image/svg+xml"]').count() >= 1  # the entry's icon
    follow(page, nav, "**/plugin/run-keys")
    frame = view(page)
    frame.locator("table.runs").wait_for()
    assert frame.locator("table.runs tbody tr").count() == 5
    assert "ui_secret.pay" in frame.locator("table.runs").inner_text()
    assert "the warehouse refused the load" in frame.locator("#attention + table").inner_text()
    page.screenshot(path=shots / "run-keys-overview.png")

    page.goto(f"{stack.base_url}/dags/ui_demo/plugin/run-keys-dag")
    frame = view(page)
    frame.locator("table.grid").wait_for()
    badges = frame.locator("table.grid tbody tr:not([hidden]) .badge").all_inner_texts()
    assert badges == ["completed", "failed", "completed", "completed"]  # 2026-10-02, then -01
    frame.locator('button.show-rerun[data-key="2026-10-01"]').click()
    form = frame.locator("#rerun-2026-10-01 form.rerun")
    form.locator("button[type=submit]").click()
    # One click only asks: the question names the DAG, the key and the two boxes.
    question = form.locator(".confirm .question")
    question.wait_for()
    assert question.inner_text() == (
        "Trigger a run of DAG ui_demo for run key 2026-10-01, Force not ticked: jobs already "
        "completed for this key are no-ops, Dry run not ticked?"
    )
    assert form.locator(".result").inner_text() == ""
    page.screenshot(path=shots / "run-keys-dag-tab.png")  # the question asked
    form.locator(".confirm button.yes").click()
    result = form.locator(".result")
    result.locator("a").wait_for()
    assert result.inner_text().startswith("Triggered manual__")
    rerun_id = result.locator("a").inner_text()
    rerun = stack.wait_for_runs("ui_demo", [rerun_id], timeout=180)[0]
    assert rerun.state == "success" and rerun.conf == {"run_key": "2026-10-01"}
    recorded = stack.api(
        "GET", f"/api/v2/dags/ui_demo/dagRuns/{urllib.parse.quote(rerun_id, safe='')}"
    )
    assert recorded["triggering_user_name"] == "operator"
    assert recorded["note"] == "Rerun of run key 2026-10-01 from the Run keys view"
    with psycopg.connect(job_dsn) as conn:
        outcomes = conn.execute(
            "SELECT outcome FROM idempotency.job_run_attempts WHERE run_id = %s", (rerun_id,)
        ).fetchall()
    assert sorted(o for (o,) in outcomes) == ["noop", "noop"]

    page.goto(
        f"{stack.base_url}/plugin/run-keys/idempotency/keys?job=ui_demo.extract&run_key=2026-10-01"
    )
    frame = view(page)
    frame.locator("#attempts").wait_for()
    outcomes_shown = frame.locator("#attempts + table tbody tr td:nth-child(2)").all_inner_texts()
    assert [o.split()[0] for o in outcomes_shown] == ["noop", "completed"]
    page.screenshot(path=shots / "run-keys-key.png")
    frame.locator(
        f'#record a[data-airflow][href$="{urllib.parse.quote(runs["ui_demo"], safe="")}"]'
    ).click()
    page.wait_for_url("**/dags/ui_demo/runs/**")
    # Airflow's router showed its own run page: the frame (and this view) is gone.
    page.wait_for_function("document.querySelectorAll('iframe').length === 0", timeout=15_000)
    assert "/plugin/" not in page.url
    page.screenshot(path=shots / "airflow-run-page.png")


def test_in_the_browser_trigger_form_and_a_jobs_calendar(
    browser: Any, stack: SignedInStack, runs: dict[str, str], shots: Path, job_dsn: str
) -> None:
    """Airflow's own trigger form shows the "Run key (business date)" field of
    idempotency_params(), and the run triggered with it processes that date; then the job's
    calendar, reached from the overview's list of jobs, shows the date done and the days
    between it and the earlier keys as missing."""
    page = signed_in(browser, stack, "operator")
    page.goto(f"{stack.base_url}/dags/ui_demo")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    field = (
        dialog.get_by_role("group")
        .filter(has=page.get_by_text("Run key (business date)", exact=True))
        .locator("input[type=date]")
    )
    field.fill("2026-10-05")
    dialog.get_by_role("button", name="Trigger").click()
    page.wait_for_url("**/dags/ui_demo/runs/manual__*")
    run_id = urllib.parse.unquote(page.url.rsplit("/runs/", 1)[1].split("/")[0])
    triggered = stack.wait_for_runs("ui_demo", [run_id], timeout=180)[0]
    assert triggered.state == "success", stack.describe_runs("ui_demo", [run_id])
    assert (triggered.conf or {}).get("run_key") == "2026-10-05"
    recorded = rows(
        job_dsn,
        "SELECT job_name, status, triggering_user FROM idempotency.job_runs"
        " WHERE run_key = '2026-10-05' AND run_id = %s ORDER BY job_name",
        (run_id,),
    )
    assert recorded == [
        ("ui_demo.extract", "completed", "operator"),
        ("ui_demo.load", "completed", "operator"),
    ]

    page.goto(f"{stack.base_url}/plugin/run-keys")
    frame = view(page)
    frame.locator("table.jobs").wait_for()
    frame.locator("table.jobs a", has_text="ui_demo.load").first.click()
    page.wait_for_url("**/plugin/run-keys/idempotency/calendar?job=ui_demo.load")
    frame = view(page)
    frame.locator("table.calendar").wait_for()
    cells = frame.locator("table.calendar td[data-state]").evaluate_all(
        "cells => cells.map(c => [c.dataset.key, c.dataset.state])"
    )
    assert cells == [
        ["2026-10-01", "completed"],
        ["2026-10-02", "failed"],
        ["2026-10-03", "missing"],
        ["2026-10-04", "missing"],
        ["2026-10-05", "completed"],
    ]
    assert frame.locator("#count-missing .n").inner_text() == "2"
    page.screenshot(path=shots / "run-keys-calendar.png")
    frame.locator('table.calendar td[data-key="2026-10-02"] a').click()
    frame.locator("#attempts").wait_for()
    assert "2026-10-02 of ui_demo.load" in frame.locator("h1").inner_text()


def test_in_the_browser_the_task_link_and_a_barred_user(
    browser: Any, stack: SignedInStack, runs: dict[str, str], shots: Path
) -> None:
    """The task instance's "Run key" button opens the key inside Airflow; a user barred from
    ui_secret sees none of it, and a viewer gets no rerun button."""
    page = signed_in(browser, stack, "viewer")
    run_id = urllib.parse.quote(runs["ui_demo"], safe="")
    page.goto(f"{stack.base_url}/dags/ui_demo/runs/{run_id}/tasks/extract/details")
    page.get_by_role("link", name="Run key", exact=True).or_(
        page.get_by_role("button", name="Run key", exact=True)
    ).first.click()
    page.wait_for_url("**/plugin/run-keys/idempotency/keys**")
    frame = view(page)
    assert "ui_demo.extract" in frame.locator("h1").inner_text()
    page.goto(f"{stack.base_url}/dags/ui_demo/plugin/run-keys-dag")
    assert view(page).locator("button.show-rerun").count() == 0

    barred = signed_in(browser, stack, "restricted")
    barred.goto(f"{stack.base_url}/plugin/run-keys")
    frame = view(barred)
    frame.locator("table.runs").wait_for()
    text = frame.locator("body").inner_text()
    assert "ui_demo.extract" in text and "ui_secret" not in text
    barred.goto(f"{stack.base_url}/dags/ui_demo/runs/{run_id}/plugin/run-keys-run")
    frame = view(barred)
    assert frame.locator("table tbody tr").count() == 2
    barred.screenshot(path=shots / "run-keys-run-tab.png")


def attempts_of_run(job_dsn: str, run_id: str) -> list[tuple[str, str, bool, bool]]:
    found = rows(
        job_dsn,
        "SELECT job_name, outcome, force, dry_run FROM idempotency.job_run_attempts"
        " WHERE run_id = %s ORDER BY job_name",
        (run_id,),
    )
    return [(str(j), str(o), bool(f), bool(d)) for j, o, f, d in found]


def rerun_from_the_key_page(page: Any, stack: SignedInStack, *, force: bool, dry_run: bool) -> str:
    """Tick the boxes on ui_demo.load's 2026-10-01 page, confirm, wait for the run; its id."""
    page.goto(
        f"{stack.base_url}/plugin/run-keys/idempotency/keys?job=ui_demo.load&run_key=2026-10-01"
    )
    form = view(page).locator("form.rerun")
    form.wait_for()
    if force:
        form.locator("input[name=force]").check()
    if dry_run:
        form.locator("input[name=dry_run]").check()
    form.locator("button[type=submit]").click()
    question = form.locator(".confirm .question").inner_text()
    assert "DAG ui_demo for run key 2026-10-01" in question
    assert ("Force ticked" in question) == force and ("Dry run ticked" in question) == dry_run
    form.locator(".confirm button.yes").click()
    form.locator(".result a").wait_for()
    run_id: str = form.locator(".result a").inner_text()
    done = stack.wait_for_runs("ui_demo", [run_id], timeout=180)[0]
    assert done.state == "success", stack.describe_runs("ui_demo", [run_id])
    expected: dict[str, Any] = {"run_key": "2026-10-01"}
    expected.update({"force": True} if force else {})
    expected.update({"dry_run": True} if dry_run else {})
    assert done.conf == expected
    return run_id


def test_in_the_browser_force_and_dry_run_do_what_they_say(
    browser: Any, stack: SignedInStack, runs: dict[str, str], job_dsn: str
) -> None:
    """A rerun with Force ticked really recomputes the completed key (its attempts are
    completed and forced, not no-ops); one with Force and Dry run ticked runs the work and
    rolls it back (dry_run attempts, the key's record still the forced run's)."""
    with psycopg.connect(job_dsn) as conn:
        record = conn.execute(
            "SELECT status, completed_at, run_id FROM idempotency.job_runs"
            " WHERE job_name = 'ui_demo.load' AND run_key = '2026-10-01'"
        ).fetchone()
    page = signed_in(browser, stack, "operator")
    forced = rerun_from_the_key_page(page, stack, force=True, dry_run=False)
    assert attempts_of_run(job_dsn, forced) == [
        ("ui_demo.extract", "completed", True, False),
        ("ui_demo.load", "completed", True, False),
    ]
    # Dry run alone of a completed key is a no-op; with Force the work runs, rolled back.
    dry = rerun_from_the_key_page(page, stack, force=True, dry_run=True)
    assert attempts_of_run(job_dsn, dry) == [
        ("ui_demo.extract", "dry_run", True, True),
        ("ui_demo.load", "dry_run", True, True),
    ]
    with psycopg.connect(job_dsn) as conn:
        after = conn.execute(
            "SELECT status, completed_at, run_id FROM idempotency.job_runs"
            " WHERE job_name = 'ui_demo.load' AND run_key = '2026-10-01'"
        ).fetchone()
    assert after is not None and record is not None
    assert (
        after[0] == "completed" and after[2] == forced
    )  # the forced run recorded, not the dry one
    page.reload()
    shown = view(page).locator("#attempts + table tbody tr td:nth-child(2)").all_inner_texts()
    assert shown[0].split() == ["dry_run", "force", "dry", "run"]
    assert shown[1].split() == ["completed", "force"]


JSON_PATHS = (
    "/idempotency/api/overview",
    "/idempotency/api/dags/ui_demo",
    "/idempotency/api/dags/ui_demo/runs/x",
    "/idempotency/api/keys?job=ui_demo.load&run_key=2026-10-01",
    "/idempotency/api/calendar?job=ui_demo.load",
    "/idempotency/api/locks",
)


def test_a_triggered_and_cleared_run_records_its_airflow_provenance(
    stack: SignedInStack, runs: dict[str, str], job_dsn: str
) -> None:
    """A run triggered through the REST API, then cleared and run again by the scheduler:
    each attempt of its ``extract`` task holds the task instance id and DAG version that
    Airflow's REST API reports for that try, the run type, the triggering user and the clear
    number (0, then 1); the key's page shows them."""
    run_id = stack.trigger_key("ui_demo", "2026-10-07")
    quoted = urllib.parse.quote(run_id, safe="")
    ti_path = f"/api/v2/dags/ui_demo/dagRuns/{quoted}/taskInstances/extract"
    first = stack.api("GET", ti_path)
    user = stack.api("GET", f"/api/v2/dags/ui_demo/dagRuns/{quoted}")["triggering_user_name"]
    stack.api("POST", f"/api/v2/dags/ui_demo/dagRuns/{quoted}/clear", {"dry_run": False})
    rerun = stack.wait_for_runs("ui_demo", [run_id], timeout=180)[0]
    assert rerun.state == "success", stack.describe_runs("ui_demo", [run_id])
    second = stack.api("GET", ti_path)
    recorded = rows(
        job_dsn,
        "SELECT outcome, try_number, run_type, triggering_user, clear_number, ti_id::text,"
        " dag_version_id::text FROM idempotency.job_run_attempts"
        " WHERE job_name = 'ui_demo.extract' AND run_id = %s ORDER BY attempt_id",
        (run_id,),
    )
    assert user is not None and first["id"] != second["id"]
    assert recorded == [
        ("completed", 1, "manual", user, 0, first["id"], first["dag_version"]["id"]),
        ("noop", 2, "manual", user, 1, second["id"], second["dag_version"]["id"]),
    ]
    status, page, _ = stack.http(
        "GET",
        "/idempotency/keys?job=ui_demo.extract&run_key=2026-10-07",
        token=stack.token,
        cookie=True,
    )
    assert status == 200 and f"ti {second['id']}" in page and ">cleared 1" in page


def test_the_api_server_answers_401_404_and_400(stack: SignedInStack, runs: dict[str, str]) -> None:
    """Through the real api-server: each JSON endpoint answers 401 without a session, an
    unknown key 404 (JSON and page), a malformed calendar range or a missing job 400 saying
    what was wrong, and the pages and answers carry the security headers."""
    for path in JSON_PATHS:
        status, body, headers = stack.http("GET", path)
        assert status == 401, (path, status, body)
        assert "location" not in {k.lower() for k in headers}
    viewer = stack.login("viewer")
    status, body, _ = stack.http(
        "GET", "/idempotency/api/keys?job=ui_demo.load&run_key=1999-01-01", token=viewer
    )
    assert status == 404 and "is not recorded" in body["detail"]
    status, page, headers = stack.http(
        "GET", "/idempotency/keys?job=ui_demo.load&run_key=1999-01-01", token=viewer, cookie=True
    )
    assert status == 404 and "is not recorded" in page
    assert "frame-ancestors 'self'" in headers["content-security-policy"]
    status, body, _ = stack.http(
        "GET", "/idempotency/api/calendar?job=ui_demo.load&from=2026-10-05&to=2026-10-01",
        token=viewer,
    )  # fmt: skip
    assert status == 400 and "comes after" in body["detail"]
    status, body, _ = stack.http("GET", "/idempotency/api/calendar", token=viewer)
    assert status == 400 and body["errors"][0]["loc"] == ["query", "job"]
    assert "job: required" in body["detail"]
    status, page, headers = stack.http("GET", "/idempotency/", token=viewer, cookie=True)
    assert status == 200
    (nonce,) = re.findall(r"script-src 'nonce-([^']+)'", headers["content-security-policy"])
    assert f'<script nonce="{nonce}">' in page
    status, _, headers = stack.http("GET", "/idempotency/api/locks", token=viewer)
    assert status == 200 and headers["x-frame-options"] == "SAMEORIGIN"
