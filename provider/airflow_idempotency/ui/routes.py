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
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, Response

from airflow_idempotency.ui import pages
from airflow_idempotency.ui.dependencies import AccessDep, ReaderDep
from airflow_idempotency.ui.rendering import Links, render, to_json

router = APIRouter()

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
            links = Links.under(str(request.scope.get("root_path", "")))
            settings = request.app.state.settings
            return HTMLResponse(render(template, links=links, settings=settings, **context))

        def json(**params: Any) -> Response:
            return Response(to_json(data(**params)), media_type="application/json")

        html.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[request, *signature.parameters.values()], return_annotation=Response
        )
        json.__signature__ = signature.replace(return_annotation=Response)  # type: ignore[attr-defined]
        name = data.__name__
        json_path = "/api" + (path if path != "/" else "/overview")
        router.add_api_route(path, html, response_class=HTMLResponse, name=f"{name}_page", **route)
        router.add_api_route(json_path, json, name=f"{name}_json", **route)
        return data

    return register


DAG_ACCESS = [Depends(requires_access_dag("GET"))]


@page("/", "overview.html")
def overview(reader: ReaderDep, query: Annotated[pages.OverviewQuery, Query()]) -> dict[str, Any]:
    """Runs that failed, run now or were interrupted, locks held, effects not confirmed, and
    every run key (filters, pages)."""
    return pages.overview(reader, query)


@page("/dags/{dag_id}", "dag.html", dependencies=DAG_ACCESS)
def dag(
    dag_id: str,
    reader: ReaderDep,
    access: AccessDep,
    query: Annotated[pages.DagQuery, Query()],
) -> dict[str, Any]:
    """A DAG's run keys: run key x job, with a rerun button per key."""
    return pages.dag(reader, access, dag_id, query)


@page("/dags/{dag_id}/runs/{run_id:path}", "run.html", dependencies=DAG_ACCESS)
def run(
    dag_id: str, run_id: str, reader: ReaderDep, query: Annotated[pages.RunQuery, Query()]
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


@page("/locks", "locks.html")
def locks(reader: ReaderDep) -> dict[str, Any]:
    """The run locks held now: holder (host, pid, attempt, DAG run) and age."""
    return pages.locks(reader)


__all__ = ["page", "router"]
