"""How the Airflow 3 view answers what it cannot show: a page saying why, or JSON.

A page that says why (HTML), or the same ``{"detail": ...}`` as JSON under ``/api``; a missing
session is Airflow's login.
"""

from __future__ import annotations

import psycopg
from airflow.api_fastapi.app import get_auth_manager
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.ui.database import ViewUnavailable, database_failure
from airflow_idempotency.ui.pages import PageError
from airflow_idempotency.ui.parameters import explain
from airflow_idempotency.ui.routes import render_page

TITLES = {
    400: "Not a valid request",
    403: "Not allowed",
    404: "Not found",
    422: "Not a valid request",
}


def wants_json(request: Request) -> bool:
    """Whether the request is for a JSON twin (``/api/...`` under the mount)."""
    root = str(request.scope.get("root_path", ""))
    path = request.url.path.removeprefix(root)
    return path == "/api" or path.startswith("/api/")


def error_response(request: Request, status: int, title: str, detail: str) -> Response:
    """``detail`` as JSON, or as the error page titled ``title``."""
    if wants_json(request):
        return JSONResponse({"detail": detail}, status_code=status)
    page = render_page(request, "error.html", title=title, detail=detail)
    return HTMLResponse(page, status_code=status)


def unavailable(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ViewUnavailable)
    if wants_json(request):
        return JSONResponse({"detail": str(exc)}, status_code=503)
    return error_response(request, 503, exc.title, exc.detail)


def database_error(request: Request, exc: Exception) -> Response:
    # A statement refused or cut short outside a page's reader: logged with an id, never a
    # bare 500, never the driver's text.
    failure = database_failure(exc, request.app.state.settings, request.url.path)
    return unavailable(request, failure)


def invalid_input(request: Request, exc: Exception) -> Response:
    return error_response(request, 400, TITLES[400], str(exc))


def query_names(request: Request) -> list[str]:
    """The query parameters the request's route takes (what an unknown one is told)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    names: list[str] = []
    for param in getattr(dependant, "query_params", []):
        model = getattr(param, "type_", None) or getattr(param.field_info, "annotation", None)
        fields = getattr(model, "model_fields", None)
        if fields:
            names += [field.alias or name for name, field in fields.items()]
        else:
            names.append(param.alias)
    return names


def invalid_request(request: Request, exc: Exception) -> Response:
    """A parameter FastAPI refused (a 400, not FastAPI's 422): a sentence per parameter
    saying what was wrong and what to send, and pydantic's errors under ``errors``."""
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    detail = explain(errors, query_names(request))
    if wants_json(request):
        listed = [{k: e[k] for k in ("type", "loc", "msg") if k in e} for e in errors]
        return JSONResponse({"detail": detail, "errors": listed}, status_code=400)
    return error_response(request, 400, TITLES[400], detail)


def page_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PageError)
    return error_response(request, exc.status, TITLES.get(exc.status, "Error"), exc.detail)


def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 401 and not wants_json(request):
        # An expired or missing session: Airflow's login, then back to this page.
        return RedirectResponse(
            get_auth_manager().get_url_login(next_url=str(request.url)), status_code=303
        )
    if wants_json(request):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)
    return error_response(
        request, exc.status_code, TITLES.get(exc.status_code, "Error"), str(exc.detail)
    )


def register_error_handlers(app: FastAPI) -> None:
    """Answer the view's own failures, the job database's and HTTP errors as above."""
    app.add_exception_handler(ViewUnavailable, unavailable)
    app.add_exception_handler(psycopg.Error, database_error)
    app.add_exception_handler(InvalidInputError, invalid_input)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(PageError, page_error)
    app.add_exception_handler(StarletteHTTPException, http_error)


__all__ = ["register_error_handlers", "wants_json"]
