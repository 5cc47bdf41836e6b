"""The FastAPI app of the Run keys view, mounted by the plugin at ``/idempotency``.

Pages (HTML, shown in Airflow's iframes) and the same data as JSON under ``/api``:

- ``/`` — overview: runs that failed, run now or were interrupted, locks held, effects not
  confirmed, and every run key (filters, pages);
- ``/dags/{dag_id}`` — a DAG's run keys: run key x job, with a rerun button per key;
- ``/dags/{dag_id}/runs/{run_id}`` — what a DAG run's idempotent tasks did (``?task_id=``);
- ``/calendar?job=...[&from=...&to=...]`` — a job's calendar: its business periods (hours,
  days, weeks or months, as its keys are), each coloured by its state, a window at a time;
- ``/keys?job=...&run_key=...`` — one run key of one job: its record, the lock's holder,
  every attempt, the outbound ledger;
- ``/locks`` — the run locks held now: holder (host, pid, attempt, DAG run) and age.

Authentication is Airflow's (the UI's ``_token`` cookie or a Bearer token); what a user sees
is what the auth manager lets them read (:func:`visibility`), applied in SQL. Reruns are
triggered by the page itself through Airflow's REST API with the user's own session, so
Airflow decides who may. The app only reads: one read-only transaction per page, on a
connection opened for the request (BENCHMARKS.md compares it with a pool).

Configuration (``airflow.cfg`` or the environment):

- ``[idempotency] ui_conn_id`` / ``AIRFLOW__IDEMPOTENCY__UI_CONN_ID``: the Airflow
  connection of the job database (default ``idempotency_default``);
- ``[idempotency] ui_schema`` / ``AIRFLOW__IDEMPOTENCY__UI_SCHEMA``: the bookkeeping schema
  (default ``idempotency``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.resources import files
from typing import Annotated, Any
from urllib.parse import quote, urlencode

import jinja2
import psycopg
from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_idempotency.exceptions import InvalidInputError, SchemaNotReadyError
from airflow_idempotency.hook import IdempotencyHook
from airflow_idempotency.schema import DEFAULT_SCHEMA, require_readable, validate_schema_name
from airflow_idempotency.ui import MOUNT, NAV_ROUTE
from airflow_idempotency.ui.reads import RecordsReader, RunFilters, Visibility

CONFIG_SECTION = "idempotency"
# Query parameters: optional text, and the two that name a key (Annotated: FastAPI copies
# the Query per parameter; one Query() object as the default of several would be shared).
OptionalText = Annotated[str | None, Query(max_length=400)]
KeyPart = Annotated[str, Query(min_length=1, max_length=400)]
FromKey = Annotated[str | None, Query(alias="from", max_length=400)]
ToKey = Annotated[str | None, Query(alias="to", max_length=400)]
STATES = ("completed", "failed", "started")


@dataclass(frozen=True)
class Settings:
    """Where the view reads: an Airflow connection and the bookkeeping schema."""

    conn_id: str = IdempotencyHook.default_conn_name
    schema: str = DEFAULT_SCHEMA

    @classmethod
    def from_airflow_config(cls) -> Settings:
        from airflow.configuration import conf

        return cls(
            conn_id=conf.get(CONFIG_SECTION, "ui_conn_id", fallback=cls.conn_id),
            schema=validate_schema_name(conf.get(CONFIG_SECTION, "ui_schema", fallback=cls.schema)),
        )


class ViewUnavailable(Exception):
    """The job database cannot be read now: shown as a 503 page that says why and what to do."""

    def __init__(self, title: str, detail: str) -> None:
        super().__init__(f"{title}: {detail}")
        self.title = title
        self.detail = detail


# -- access ---------------------------------------------------------------------------------


def visibility(user: Any) -> Visibility:
    """What ``user`` may read: the DAG ids the auth manager authorizes, one by one; and every
    DAG (records written outside Airflow, records of DAGs Airflow no longer knows) only when
    it grants DAG access without naming a DAG and the authorized ids are all the DAGs there
    are. (A check without a DAG id alone is not enough: in multi-team mode it passes for a
    team's users, whose DAGs are a subset.)"""
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    manager = get_auth_manager()
    authorized = frozenset(manager.get_authorized_dag_ids(user=user, method="GET"))
    every = manager.is_authorized_dag(method="GET", user=user)
    if every:
        with create_session() as session:
            every = authorized.issuperset(session.scalars(select(DagModel.dag_id)))
    return Visibility(every, authorized)


def can_trigger(user: Any, dag_id: str | None) -> bool:
    """Whether ``user`` may create runs of ``dag_id`` (what the REST API's trigger checks)."""
    if not dag_id:
        return False
    from airflow.models.dag import DagModel

    return get_auth_manager().is_authorized_dag(
        method="POST",
        access_entity=DagAccessEntity.RUN,
        details=DagDetails(id=dag_id, team_name=DagModel.get_team_name(dag_id)),
        user=user,
    )


def dag_is_paused(dag_id: str) -> bool | None:
    """Whether the DAG is paused (a triggered run then waits); None if Airflow does not know it."""
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        paused = session.scalar(select(DagModel.is_paused).where(DagModel.dag_id == dag_id))
    return None if paused is None else bool(paused)


# -- the job database -------------------------------------------------------------------------


@contextmanager
def open_reader(settings: Settings, user: Any) -> Iterator[RecordsReader]:
    """A reader for ``user`` on a new connection to the job database, closed afterwards.

    No DDL ever: a missing or older schema is refused (:class:`ViewUnavailable`).
    """
    try:
        kwargs = IdempotencyHook(postgres_conn_id=settings.conn_id).connection_kwargs()
    except Exception as exc:
        if type(exc).__name__ != "AirflowNotFoundException":
            raise
        raise ViewUnavailable(
            "No job database",
            f"the Airflow connection {settings.conn_id!r} is not defined. Create it, or name "
            f"another one in [{CONFIG_SECTION}] ui_conn_id "
            f"(AIRFLOW__{CONFIG_SECTION.upper()}__UI_CONN_ID).",
        ) from exc
    kwargs.setdefault("connect_timeout", 10)
    kwargs.setdefault("application_name", "airflow-idempotency ui")
    try:
        conn = psycopg.connect(**kwargs, autocommit=True, prepare_threshold=None)
    except psycopg.OperationalError as exc:
        raise ViewUnavailable(
            "Cannot reach the job database",
            f"connection {settings.conn_id!r}: {str(exc).strip()}",
        ) from exc
    with conn:
        try:
            require_readable(conn, settings.schema)
        except SchemaNotReadyError as exc:
            hint = (
                "No idempotent task has run against this database yet, or the connection "
                f"{settings.conn_id!r} ([{CONFIG_SECTION}] ui_conn_id) or the schema "
                f"([{CONFIG_SECTION}] ui_schema) point elsewhere."
                if exc.version == 0
                else "The next idempotent task of this provider version migrates it, or run "
                "`airflow-idempotency migrate`. This view never changes the schema."
            )
            raise ViewUnavailable("The job database is not ready", f"{exc}. {hint}") from exc
        yield RecordsReader(conn, settings.schema, visibility(user))


# -- rendering --------------------------------------------------------------------------------


def _ts(value: dt.datetime | None) -> str:
    if value is None:
        return ""
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _duration(start: dt.datetime | None, end: dt.datetime | None) -> str:
    if start is None or end is None:
        return ""
    seconds = (end - start).total_seconds()
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _age(value: dt.timedelta | None) -> str:
    """``3 h 12 min``, ``4 min 05 s``, ``12 s``."""
    if value is None:
        return ""
    seconds = int(value.total_seconds())
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


def _json_default(value: Any) -> Any:
    """What ``json.dumps`` cannot encode itself, as FastAPI's jsonable_encoder would encode
    it (ISO timestamps, seconds for durations); records (dataclasses) one level at a time,
    never deep-copied (``dataclasses.asdict`` and jsonable_encoder took most of a
    calendar's time: BENCHMARKS.md)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return jsonable_encoder(value)


def _details(value: Any) -> str:
    return json.dumps(value, indent=1, sort_keys=True, default=str) if value else ""


def _counts(details: Any) -> str:
    """The numeric counts of a run's details, short: ``invoices_created=40 orders_seen=40``."""
    if not isinstance(details, dict):
        return ""
    return " ".join(
        f"{k}={v}"
        for k, v in sorted(details.items())
        if isinstance(v, int | float) and v is not True
    )


@dataclass(frozen=True)
class Links:
    """URLs of this app's pages and of Airflow's, for one request (its root path)."""

    app_root: str
    airflow_root: str

    @classmethod
    def of(cls, request: Request) -> Links:
        root = str(request.scope.get("root_path", "")).rstrip("/")
        airflow_root = root[: -len(MOUNT)] if root.endswith(MOUNT) else root
        return cls(root, airflow_root)

    def page(self, path: str, **params: Any) -> str:
        """A page of this app; a trailing ``_`` of a parameter's name is dropped (``from_``)."""
        query = urlencode(
            {k.removesuffix("_"): v for k, v in params.items() if v not in (None, "")}
        )
        return f"{self.app_root}{path}" + (f"?{query}" if query else "")

    def key(self, job_name: str, run_key: str) -> str:
        return self.page("/keys", job=job_name, run_key=run_key)

    def calendar(
        self, job_name: str, from_key: str | None = None, to_key: str | None = None
    ) -> str:
        return self.page("/calendar", job=job_name, from_=from_key, to_=to_key)

    def dag_tab(self, dag_id: str, **params: Any) -> str:
        return self.page(f"/dags/{quote(dag_id, safe='')}", **params)

    def run_tab(self, dag_id: str, run_id: str, **params: Any) -> str:
        return self.page(f"/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}", **params)

    def airflow_dag(self, dag_id: str) -> str:
        return f"{self.airflow_root}/dags/{quote(dag_id, safe='')}"

    def airflow_run(self, dag_id: str, run_id: str) -> str:
        return f"{self.airflow_dag(dag_id)}/runs/{quote(run_id, safe='')}"

    def airflow_task(self, dag_id: str, run_id: str, task_id: str, map_index: int | None) -> str:
        url = f"{self.airflow_run(dag_id, run_id)}/tasks/{quote(task_id, safe='')}"
        return url if map_index is None else f"{url}/mapped/{map_index}"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(files("airflow_idempotency.ui") / "templates")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(ts=_ts, details=_details, counts=_counts, age=_age)
    env.globals.update(duration=_duration, nav_route=NAV_ROUTE)
    return env


# -- the app ----------------------------------------------------------------------------------


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app (``settings``: from Airflow's configuration unless given)."""
    settings = settings or Settings.from_airflow_config()
    templates = _environment()
    app = FastAPI(title="Run keys", docs_url=None, redoc_url=None, openapi_url=None)

    def render(
        request: Request, template: str, status_code: int = 200, **context: Any
    ) -> HTMLResponse:
        page = templates.get_template(template).render(
            links=Links.of(request), settings=settings, **context
        )
        return HTMLResponse(page, status_code=status_code)

    def wants_json(request: Request) -> bool:
        return request.url.path.removeprefix(str(request.scope.get("root_path", ""))).startswith(
            "/api/"
        )

    @app.exception_handler(ViewUnavailable)
    def unavailable(request: Request, exc: ViewUnavailable) -> Response:
        if wants_json(request):
            return JSONResponse({"detail": str(exc)}, status_code=503)
        return render(request, "error.html", 503, title=exc.title, detail=exc.detail)

    @app.exception_handler(psycopg.Error)
    def database_error(request: Request, exc: psycopg.Error) -> Response:
        # A statement refused or cut short (permissions, the statement timeout, a lost
        # server): said as it is, never a bare 500.
        detail = f"connection {settings.conn_id!r}: {type(exc).__name__}: {str(exc).strip()}"
        if wants_json(request):
            return JSONResponse({"detail": detail}, status_code=503)
        return render(
            request, "error.html", 503, title="The job database refused a read", detail=detail
        )

    @app.exception_handler(InvalidInputError)
    def invalid_input(request: Request, exc: InvalidInputError) -> Response:
        if wants_json(request):
            return JSONResponse({"detail": str(exc)}, status_code=422)
        return render(request, "error.html", 422, title="Not a valid request", detail=str(exc))

    @app.exception_handler(StarletteHTTPException)
    def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if wants_json(request):
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)
        if exc.status_code == 401:
            # An expired or missing session: Airflow's login, then back to this page.
            return RedirectResponse(
                get_auth_manager().get_url_login(next_url=str(request.url)), status_code=303
            )
        titles = {403: "Not allowed", 404: "Not found"}
        return render(
            request,
            "error.html",
            exc.status_code,
            title=titles.get(exc.status_code, "Error"),
            detail=str(exc.detail),
        )

    def not_visible(what: str) -> HTTPException:
        return HTTPException(404, f"{what} is not recorded, or you may not read its DAG.")

    # -- data (shared by the pages and the JSON API) ----------------------------------------

    def overview_data(
        user: Any,
        job: str | None,
        status: str | None,
        dag_id: str | None,
        from_key: str | None,
        to_key: str | None,
        before_key: str | None,
        before_job: str | None,
    ) -> dict[str, Any]:
        if status is not None and status not in STATES:
            raise HTTPException(400, f"status must be one of {', '.join(STATES)}")
        filters = RunFilters(job, status, dag_id, from_key, to_key)
        before = (before_key, before_job) if before_key and before_job else None
        with open_reader(settings, user) as reader:
            overview = reader.overview(filters, before)
        return {"filters": filters, "overview": overview}

    def dag_data(user: Any, dag_id: str, before_key: str | None) -> dict[str, Any]:
        with open_reader(settings, user) as reader:
            keys = reader.dag_keys(dag_id, before_key)
        return {
            "dag": keys,
            "can_trigger": can_trigger(user, dag_id),
            "paused": dag_is_paused(dag_id),
            "before_key": before_key,
        }

    def run_data(user: Any, dag_id: str, run_id: str, task_id: str | None) -> dict[str, Any]:
        with open_reader(settings, user) as reader:
            return {"run": reader.run_attempts(dag_id, run_id, task_id)}

    def key_data(user: Any, job: str, run_key: str) -> dict[str, Any]:
        with open_reader(settings, user) as reader:
            detail = reader.key(job, run_key)
        if detail is None:
            raise not_visible(f"Run key {run_key!r} of job {job!r}")
        dag_id = detail.run["dag_id"] if detail.run else None
        return {
            "key": detail,
            "dag_id": dag_id,
            "can_trigger": can_trigger(user, dag_id),
            "paused": dag_is_paused(dag_id) if dag_id else None,
        }

    def calendar_data(
        user: Any, job: str, from_key: str | None, to_key: str | None
    ) -> dict[str, Any]:
        with open_reader(settings, user) as reader:
            found = reader.calendar(job, from_key, to_key)
        if found is None:
            raise not_visible(f"Job {job!r}")
        return {"calendar": found}

    def locks_data(user: Any) -> dict[str, Any]:
        with open_reader(settings, user) as reader:
            return {"locks": reader.locks()}

    def as_json(data: dict[str, Any]) -> Response:
        return Response(
            json.dumps(data, default=_json_default, separators=(",", ":")),
            media_type="application/json",
        )

    dag_access = [Depends(requires_access_dag("GET"))]

    # -- pages and their JSON --------------------------------------------------------------

    @app.get("/", response_class=HTMLResponse)
    def overview_page(
        request: Request,
        user: GetUserDep,
        job: OptionalText = None,
        status: OptionalText = None,
        dag_id: OptionalText = None,
        from_key: FromKey = None,
        to_key: ToKey = None,
        before_key: OptionalText = None,
        before_job: OptionalText = None,
    ) -> Response:
        data = overview_data(user, job, status, dag_id, from_key, to_key, before_key, before_job)
        return render(request, "overview.html", states=STATES, **data)

    @app.get("/api/overview")
    def overview_json(
        user: GetUserDep,
        job: OptionalText = None,
        status: OptionalText = None,
        dag_id: OptionalText = None,
        from_key: FromKey = None,
        to_key: ToKey = None,
        before_key: OptionalText = None,
        before_job: OptionalText = None,
    ) -> Response:
        return as_json(
            overview_data(user, job, status, dag_id, from_key, to_key, before_key, before_job)
        )

    @app.get("/dags/{dag_id}", response_class=HTMLResponse, dependencies=dag_access)
    def dag_page(
        request: Request, dag_id: str, user: GetUserDep, before_key: OptionalText = None
    ) -> Response:
        return render(request, "dag.html", **dag_data(user, dag_id, before_key))

    @app.get("/api/dags/{dag_id}", dependencies=dag_access)
    def dag_json(dag_id: str, user: GetUserDep, before_key: OptionalText = None) -> Response:
        return as_json(dag_data(user, dag_id, before_key))

    @app.get(
        "/dags/{dag_id}/runs/{run_id:path}", response_class=HTMLResponse, dependencies=dag_access
    )
    def run_page(
        request: Request, dag_id: str, run_id: str, user: GetUserDep, task_id: OptionalText = None
    ) -> Response:
        return render(request, "run.html", **run_data(user, dag_id, run_id, task_id))

    @app.get("/api/dags/{dag_id}/runs/{run_id:path}", dependencies=dag_access)
    def run_json(
        dag_id: str, run_id: str, user: GetUserDep, task_id: OptionalText = None
    ) -> Response:
        return as_json(run_data(user, dag_id, run_id, task_id))

    @app.get("/calendar", response_class=HTMLResponse)
    def calendar_page(
        request: Request,
        user: GetUserDep,
        job: KeyPart,
        from_key: FromKey = None,
        to_key: ToKey = None,
    ) -> Response:
        return render(request, "calendar.html", **calendar_data(user, job, from_key, to_key))

    @app.get("/api/calendar")
    def calendar_json(
        user: GetUserDep, job: KeyPart, from_key: FromKey = None, to_key: ToKey = None
    ) -> Response:
        return as_json(calendar_data(user, job, from_key, to_key))

    @app.get("/locks", response_class=HTMLResponse)
    def locks_page(request: Request, user: GetUserDep) -> Response:
        return render(request, "locks.html", **locks_data(user))

    @app.get("/api/locks")
    def locks_json(user: GetUserDep) -> Response:
        return as_json(locks_data(user))

    @app.get("/keys", response_class=HTMLResponse)
    def key_page(request: Request, user: GetUserDep, job: KeyPart, run_key: KeyPart) -> Response:
        return render(request, "key.html", **key_data(user, job, run_key))

    @app.get("/api/keys")
    def key_json(user: GetUserDep, job: KeyPart, run_key: KeyPart) -> Response:
        return as_json(key_data(user, job, run_key))

    return app


__all__ = ["Links", "Settings", "ViewUnavailable", "can_trigger", "create_app", "visibility"]
