"""The FastAPI app of the Run keys view (Airflow 3), mounted by the plugin at ``/idempotency``.

Pages (HTML, shown in Airflow's iframes) and the same data as JSON under ``/api``
(:mod:`.routes`):

- ``/`` — overview: runs that failed, run now or were interrupted, locks held, effects not
  confirmed, and every run key (filters, pages);
- ``/dags/{dag_id}`` — a DAG's run keys: run key x job, with a rerun button per key;
- ``/dags/{dag_id}/runs/{run_id}`` — what a DAG run's idempotent tasks did (``?task_id=``);
- ``/calendar?job=...[&from=...&to=...]`` — a job's calendar, a window at a time;
- ``/keys?job=...&run_key=...`` — one run key of one job: its record, the lock's holder,
  every attempt, the outbound ledger;
- ``/locks`` — the run locks held now: holder (host, pid, attempt, DAG run) and age;
- ``/api/openapi.json`` — the OpenAPI schema of the JSON twins: each parameter, its type and
  limits, and what each answers (a refused parameter is a 400 that names it).

Authentication and authorization are Airflow's (:mod:`.dependencies`). Reruns are triggered
by the page itself through Airflow's REST API with the user's own session, so Airflow
decides who may. The app only reads: one read-only transaction per page.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.datastructures import MutableHeaders

from airflow_idempotency.ui.errors import register_error_handlers
from airflow_idempotency.ui.headers import new_nonce, security_headers
from airflow_idempotency.ui.routes import router
from airflow_idempotency.ui.settings import Settings


class SecurityHeaders:
    """ASGI middleware: every response gets the view's security headers (.headers), a page
    with the nonce its template was rendered with (``request.state.csp_nonce``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        nonce = new_nonce()
        scope.setdefault("state", {})["csp_nonce"] = nonce

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                html = headers.get("content-type", "").startswith("text/html")
                for name, value in security_headers(nonce if html else None).items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def openapi_of(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The schema of the JSON twins (``/api/openapi.json``), as they answer: a refused
    parameter is a 400 (.errors), so FastAPI's 422 is left out."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            built = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in built.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                built.get("components", {}).get("schemas", {}).pop(unused, None)
            app.openapi_schema = built
        return app.openapi_schema

    return schema


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app (``settings``: from Airflow's configuration unless given)."""
    app = FastAPI(
        title="Run keys",
        version="1",
        docs_url=None,
        redoc_url=None,
        openapi_url="/api/openapi.json",
        # No 307 to the address without its trailing slash (``/dags/d/runs/.`` becomes
        # ``/dags/d/runs/``): a 404 as the schema documents it.
        redirect_slashes=False,
    )
    app.openapi = openapi_of(app)  # type: ignore[method-assign]
    app.state.settings = settings or Settings.from_airflow_config()
    app.include_router(router)
    register_error_handlers(app)
    app.add_middleware(SecurityHeaders)
    return app


__all__ = ["SecurityHeaders", "Settings", "create_app"]
