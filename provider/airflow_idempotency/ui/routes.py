"""The routes of the Airflow 3 view: each page and its JSON twin under ``/api``.

As Airflow's own ``api_fastapi/core_api/routes/public/*.py``: a module-level router, one
top-level function per page, the query as one object (``Annotated[..., Query()]``) and the
reader, the access and the settings as dependencies. Each function returns the page's data
(:mod:`.pages`); :func:`page` registers it twice, as the HTML page rendered from its
template and as the JSON twin that answers the same data.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any

from airflow.api_fastapi.core_api.security import requires_access_dag
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from pydantic import AfterValidator, BaseModel

from airflow_idempotency.ui import pages
from airflow_idempotency.ui.dependencies import AccessDep, ReaderDep
from airflow_idempotency.ui.parameters import TEXT_LIMIT, TEXT_PATTERN, printable
from airflow_idempotency.ui.rendering import Links, render, to_json


def render_page(request: Request, template: str, **context: Any) -> str:
    """``template`` for this request: its links (under its root path), the settings and the
    CSP nonce of its response (:class:`.app.SecurityHeaders`)."""
    return render(
        template,
        links=Links.under(str(request.scope.get("root_path", ""))),
        settings=request.app.state.settings,
        nonce=request.state.csp_nonce,
        **context,
    )


def checked_query(request: Request) -> None:
    """Refuse a query parameter sent more than once (``?job=a&job=b``): which one was meant
    is a guess (FastAPI keeps the last, Flask's ``to_dict`` the first), so neither is."""
    counts: dict[str, int] = {}
    for name, _ in request.query_params.multi_items():
        counts[name] = counts.get(name, 0) + 1
    errors = [
        {"type": "value_error", "loc": ("query", name), "msg": f"sent {n} times; send it once"}
        for name, n in counts.items()
        if n > 1
    ]
    if errors:
        raise RequestValidationError(errors)


def no_query(request: Request) -> None:
    """Refuse every query parameter of a page that takes none (as a misspelt one elsewhere)."""
    if request.query_params:
        raise RequestValidationError(
            [
                {"type": "extra_forbidden", "loc": ("query", name), "msg": "not a parameter"}
                for name in dict.fromkeys(request.query_params.keys())
            ]
        )


router = APIRouter(dependencies=[Depends(checked_query)])


class Refusal(BaseModel):
    """Why a JSON twin answers no data: ``detail`` says what was wrong and what to do;
    ``errors`` (a 400) lists each parameter refused, as pydantic locates it."""

    detail: str | list[Any]
    errors: list[dict[str, Any]] | None = None


JSON_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {"schema": {"type": "object"}}}},
    400: {"model": Refusal, "description": "A parameter is not valid (which, and why)"},
    401: {"model": Refusal, "description": "Not signed in to Airflow"},
    403: {"model": Refusal, "description": "Airflow does not let this user read it"},
    404: {"model": Refusal, "description": "Not recorded, or a DAG the user may not read"},
    503: {"model": Refusal, "description": "The job database cannot be read now"},
}
"""What the OpenAPI schema of ``/api`` says each JSON twin may answer (:mod:`.app`)."""

DataFunction = Callable[..., dict[str, Any]]


def page(path: str, template: str, **route: Any) -> Callable[[DataFunction], DataFunction]:
    """Register ``data`` as the page ``path`` (``template`` rendered with its data) and as
    its JSON twin ``/api<path>`` (``/api/overview`` for ``/``); ``route`` goes to both."""

    def register(data: DataFunction) -> DataFunction:
        signature = inspect.signature(data, eval_str=True)
        request = inspect.Parameter(
            "request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request
        )

        def html(request: Request, **params: Any) -> Response:
            context = data(**params)
            return HTMLResponse(render_page(request, template, **context))

        def json(**params: Any) -> Response:
            return Response(to_json(data(**params)), media_type="application/json")

        html.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[request, *signature.parameters.values()], return_annotation=Response
        )
        json.__signature__ = signature.replace(return_annotation=Response)  # type: ignore[attr-defined]
        name = data.__name__
        json_path = "/api" + (path if path != "/" else "/overview")
        router.add_api_route(
            path,
            html,
            response_class=HTMLResponse,
            name=f"{name}_page",
            include_in_schema=False,
            **route,
        )
        router.add_api_route(
            json_path, json, name=f"{name}_json", responses=JSON_RESPONSES, **route
        )
        return data

    return register


def checked_path(request: Request) -> None:
    """Refuse a path parameter that no DAG or run id can be (a control character, too long)
    before the DAG access check reads it: as FastAPI refuses a query's (a 400)."""
    errors = []
    for name, value in request.path_params.items():
        try:
            printable(value)
            if len(value) > TEXT_LIMIT:
                raise ValueError(f"longer than {TEXT_LIMIT} characters; send a shorter value")
        except ValueError as exc:
            errors.append({"type": "value_error", "loc": ("path", name), "msg": str(exc)})
    if errors:
        raise RequestValidationError(errors)


DAG_ACCESS = [Depends(checked_path), Depends(requires_access_dag("GET"))]

PathText = Annotated[
    str,
    Path(min_length=1, max_length=TEXT_LIMIT, json_schema_extra={"pattern": TEXT_PATTERN}),
    AfterValidator(printable),
]
"""A path parameter (a DAG id, a run id): as a query's text (.parameters.Text)."""


@page("/", "overview.html")
def overview(reader: ReaderDep, query: Annotated[pages.OverviewQuery, Query()]) -> dict[str, Any]:
    """Runs that failed, run now or were interrupted, locks held, effects not confirmed, and
    every run key (filters, pages)."""
    return pages.overview(reader, query)


@page("/dags/{dag_id}", "dag.html", dependencies=DAG_ACCESS)
def dag(
    dag_id: PathText,
    reader: ReaderDep,
    access: AccessDep,
    query: Annotated[pages.DagQuery, Query()],
) -> dict[str, Any]:
    """A DAG's run keys: run key x job, with a rerun button per key."""
    return pages.dag(reader, access, dag_id, query)


@page("/dags/{dag_id}/runs/{run_id:path}", "run.html", dependencies=DAG_ACCESS)
def run(
    dag_id: PathText, run_id: PathText, reader: ReaderDep, query: Annotated[pages.RunQuery, Query()]
) -> dict[str, Any]:
    """What a DAG run's idempotent tasks did (``?task_id=``)."""
    return pages.run(reader, dag_id, run_id, query)


@page("/calendar", "calendar.html")
def calendar(reader: ReaderDep, query: Annotated[pages.CalendarQuery, Query()]) -> dict[str, Any]:
    """A job's calendar: its business periods, each coloured by its state, a window at a time."""
    return pages.calendar(reader, query)


@page("/keys", "key.html")
def key(
    reader: ReaderDep, access: AccessDep, query: Annotated[pages.KeyQuery, Query()]
) -> dict[str, Any]:
    """One run key of one job: its record, the lock's holder, every attempt, the ledger."""
    return pages.key(reader, access, query)


@page("/locks", "locks.html", dependencies=[Depends(no_query)])
def locks(reader: ReaderDep) -> dict[str, Any]:
    """The run locks held now: holder (host, pid, attempt, DAG run) and age."""
    return pages.locks(reader)


__all__ = ["JSON_RESPONSES", "Refusal", "page", "render_page", "router"]
