"""The Run keys view of the Airflow 2.11 webserver: a Flask AppBuilder view in the main menu.

The same pages as the Airflow 3 view (:mod:`.routes`), from the same query objects and data
functions (:mod:`.pages`), the same reads and the same templates; what differs is here: the
user, authorization through the auth manager of Airflow 2.11 (FAB's security manager), the
links (:class:`.rendering.Airflow2Links`) and CSRF. Imported only by the webserver, when it
asks the plugin for its ``appbuilder_views``; nothing else of Flask is imported before.

Under ``/runkeys`` (the menu's "Run keys"):

- ``/runkeys/<page>`` (``/``, ``/dags/<dag_id>``, ``/dags/<dag_id>/runs/<run_id>``,
  ``/calendar``, ``/keys``, ``/locks``): Airflow's page (its menu, its login) around an
  iframe that shows ``/runkeys/page/<page>``, the view's own document, with the view's
  strict Content-Security-Policy (Airflow 2's own pages have inline scripts that no nonce
  covers, so they could not have it); the address bar follows the frame;
- ``/runkeys/api/<page>``: the same data as JSON (``/runkeys/api/overview`` for ``/``);
- ``/runkeys/task?dag_id=&run_id=&task_id=[&map_index=]``: the operator's "Run key" link:
  the key the task's newest attempt recorded, or its run's attempts.

Who sees what: the user must be signed in (a page redirects to FAB's login and back, the
JSON answers 401) and may read the website; a record shows only if the auth manager lets
the user read its DAG (``get_permitted_dag_ids``); a DAG's pages need read access to that
DAG; the rerun button shows only to users who may create runs of the DAG, and posts to
``/api/v1/dags/<dag_id>/dagRuns`` with the user's session and CSRF token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from flask import Response, redirect, request
from flask_appbuilder import BaseView, expose
from pydantic import BaseModel, ValidationError

from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.ui import AIRFLOW2_ROUTE, pages
from airflow_idempotency.ui.database import ViewUnavailable, open_reader
from airflow_idempotency.ui.headers import new_nonce, security_headers
from airflow_idempotency.ui.parameters import TEXT_LIMIT, explain, printable
from airflow_idempotency.ui.reads import RecordsReader, Visibility
from airflow_idempotency.ui.rendering import Airflow2Links, render, to_json
from airflow_idempotency.ui.settings import Settings

log = logging.getLogger(__name__)

ROUTE_BASE = AIRFLOW2_ROUTE
MENU_NAME = "Run keys"
FRAME = "/page"

# -- who the user is and what they may do (Airflow 2.11's auth manager) ----------------------


def _auth_manager() -> Any:
    from airflow.www.extensions.init_auth_manager import get_auth_manager

    return get_auth_manager()


def visibility() -> Visibility:
    """What the signed-in user may read: the DAG ids the auth manager permits, and every
    DAG only when it grants DAG access without naming one and those ids are all the DAGs
    there are (as :func:`.dependencies.visibility` on Airflow 3)."""
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    manager = _auth_manager()
    authorized = frozenset(manager.get_permitted_dag_ids(methods=["GET"]))
    every = bool(manager.is_authorized_dag(method="GET"))
    if every:
        with create_session() as session:
            every = authorized.issuperset(session.scalars(select(DagModel.dag_id)))
    return Visibility(every, authorized)


def may_read_dag(dag_id: str) -> bool:
    from airflow.auth.managers.models.resource_details import DagDetails

    return bool(_auth_manager().is_authorized_dag(method="GET", details=DagDetails(id=dag_id)))


class Airflow2Access:
    """What the signed-in user may do, as Airflow 2.11's auth manager says
    (:class:`.pages.Access`)."""

    def can_trigger(self, dag_id: str | None) -> bool:
        """Whether the user may create runs of ``dag_id`` (what ``POST /api/v1/dags/{id}/dagRuns``
        checks)."""
        if not dag_id:
            return False
        from airflow.auth.managers.models.resource_details import DagAccessEntity, DagDetails

        return bool(
            _auth_manager().is_authorized_dag(
                method="POST", access_entity=DagAccessEntity.RUN, details=DagDetails(id=dag_id)
            )
        )

    def dag_is_paused(self, dag_id: str) -> bool | None:
        from airflow.models.dag import DagModel
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            paused = session.scalar(select(DagModel.is_paused).where(DagModel.dag_id == dag_id))
        return None if paused is None else bool(paused)


# -- the pages --------------------------------------------------------------------------------

Data = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class Page:
    """One page: its path (Flask's syntax), template, query object and data function
    (``data(reader, access, query, **path parameters)``); ``dag`` pages need read access to
    the DAG of their ``dag_id``."""

    endpoint: str
    path: str
    template: str
    query: type[BaseModel] | None
    data: Data
    dag: bool = False

    @property
    def json_path(self) -> str:
        return "/api" + (self.path if self.path != "/" else "/overview")


PAGES = (
    Page("overview", "/", "overview.html", pages.OverviewQuery,
         lambda reader, access, query: pages.overview(reader, query)),
    Page("dag", "/dags/<dag_id>", "dag.html", pages.DagQuery,
         lambda reader, access, query, dag_id: pages.dag(reader, access, dag_id, query), dag=True),
    Page("run", "/dags/<dag_id>/runs/<path:run_id>", "run.html", pages.RunQuery,
         lambda reader, access, query, dag_id, run_id: pages.run(reader, dag_id, run_id, query),
         dag=True),
    Page("calendar", "/calendar", "calendar.html", pages.CalendarQuery,
         lambda reader, access, query: pages.calendar(reader, query)),
    Page("key", "/keys", "key.html", pages.KeyQuery,
         lambda reader, access, query: pages.key(reader, access, query)),
    Page("locks", "/locks", "locks.html", None,
         lambda reader, access, query: pages.locks(reader)),
)  # fmt: skip

TITLES = {
    400: "Not a valid request",
    403: "Not allowed",
    404: "Not found",
    422: "Not a valid request",
}


class RunKeysView(BaseView):  # type: ignore[misc]
    """The view (FAB registers its blueprint under :data:`ROUTE_BASE`)."""

    route_base = ROUTE_BASE
    default_view = "overview_frame"

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings
        super().__init__()

    def settings(self) -> Settings:
        """The view's settings, read from Airflow's configuration on first use (not when
        FAB builds the view: it reads every attribute of it)."""
        if self._settings is None:
            self._settings = Settings.from_airflow_config()
        return self._settings

    def create_blueprint(
        self, appbuilder: Any, endpoint: Any = None, static_folder: Any = None
    ) -> Any:
        blueprint = super().create_blueprint(appbuilder, endpoint, static_folder)
        for page in PAGES:
            if page.path != "/":  # FAB registers the default view's own rule
                blueprint.add_url_rule(page.path, f"{page.endpoint}_frame", self._outer(page))
            blueprint.add_url_rule(
                FRAME + page.path, f"{page.endpoint}_page", self._responder(page, as_json=False)
            )
            blueprint.add_url_rule(
                page.json_path, f"{page.endpoint}_json", self._responder(page, as_json=True)
            )
        blueprint.add_url_rule("/task", "task", self.task)
        blueprint.before_app_request(self._grant_menu_once)
        return blueprint

    _menu_granted = False

    def _grant_menu_once(self) -> None:
        """Grant "menu access on Run keys" to the roles of ``[idempotency] ui_menu_roles``
        (once per webserver process, at its first request: the roles exist by then). FAB
        shows a plugin's menu entry only to roles with that permission, and its default roles
        get none; what each user then sees is filtered by their DAG permissions."""
        if self._menu_granted:
            return
        self._menu_granted = True
        try:
            security = self.appbuilder.sm
            permission = security.create_permission("menu_access", MENU_NAME)
            for name in self.settings().menu_roles:
                role = security.find_role(name)
                if role is not None and permission not in role.permissions:
                    security.add_permission_to_role(role, permission)
        except Exception:  # another worker granted it first, or the database refused
            log.warning(
                "Run keys: could not grant the menu to %s",
                self.settings().menu_roles,
                exc_info=True,
            )

    @expose("/")  # type: ignore[untyped-decorator]
    def overview_frame(self) -> Any:
        """The menu's link: the overview."""
        return self._outer(PAGES[0])()

    # -- responses ---------------------------------------------------------------------------

    def _links(self) -> Airflow2Links:
        from flask_wtf.csrf import generate_csrf

        root = request.script_root.rstrip("/")
        return Airflow2Links(
            app_root=f"{root}{ROUTE_BASE}{FRAME}",
            airflow_root=root,
            top_root=f"{root}{ROUTE_BASE}",
            csrf_token=generate_csrf(),
        )

    def _html(self, template: str, status: int = 200, **context: Any) -> Response:
        nonce = new_nonce()
        page = render(
            template, links=self._links(), settings=self.settings(), nonce=nonce, **context
        )
        return Response(page, status=status, mimetype="text/html", headers=security_headers(nonce))

    def _json(self, data: Any, status: int = 200) -> Response:
        body = data if isinstance(data, str) else to_json(data)
        return Response(
            body, status=status, mimetype="application/json", headers=security_headers(None)
        )

    def _error(self, as_json: bool, status: int, title: str, detail: Any) -> Response:
        if as_json:
            return self._json({"detail": detail}, status)
        return self._html("error.html", status, title=title, detail=str(detail))

    def _refused_input(
        self, as_json: bool, errors: list[dict[str, Any]], model: type[BaseModel] | None
    ) -> Response:
        """A 400 saying which parameter was wrong and what to send (as on Airflow 3)."""
        allowed = [f.alias or n for n, f in model.model_fields.items()] if model else []
        detail = explain(errors, allowed)
        if as_json:
            return self._json({"detail": detail, "errors": errors}, 400)
        return self._html("error.html", 400, title=TITLES[400], detail=detail)

    def _refusal(self, as_json: bool) -> Response | None:
        """401 / the login page for a user not signed in, 403 for one who may not read the
        website; None when the user may go on."""
        from airflow.auth.managers.models.resource_details import AccessView

        manager = _auth_manager()
        if not manager.is_logged_in():
            if as_json:
                return self._json({"detail": "Not authenticated"}, 401)
            return redirect(manager.get_url_login(next_url=request.url))
        if not manager.is_authorized_view(access_view=AccessView.WEBSITE):
            return self._error(as_json, 403, TITLES[403], "You may not read Airflow's website.")
        return None

    def _outer(self, page: Page) -> Callable[..., Any]:
        """Airflow's page with the frame of ``page`` (its path and query string)."""

        def outer(**path: str) -> Any:
            refused = self._refusal(as_json=False)
            if refused is not None:
                return refused
            suffix = request.full_path[len(request.script_root + ROUTE_BASE) :].rstrip("?")
            if suffix in ("", "/"):
                suffix = "/"
            return self._frame_page(f"{request.script_root}{ROUTE_BASE}{FRAME}{suffix}")

        outer.__name__ = f"{page.endpoint}_frame"
        return outer

    def _frame_page(self, src: str) -> Any:
        from flask import render_template_string

        return render_template_string(
            FRAME_TEMPLATE,
            base_template=self.appbuilder.base_template,
            appbuilder=self.appbuilder,
            title=MENU_NAME,
            src=src,
        )

    def _responder(self, page: Page, as_json: bool) -> Callable[..., Response]:
        def respond(**path: str) -> Response:
            return self._respond(page, as_json, path)

        respond.__name__ = f"{page.endpoint}_{'json' if as_json else 'page'}"
        return respond

    def _respond(self, page: Page, as_json: bool, path: dict[str, str]) -> Response:
        refused = self._refusal(as_json)
        if refused is not None:
            return refused
        errors = [e for name, value in path.items() for e in _path_errors(name, value)]
        if not errors and page.dag and not may_read_dag(path["dag_id"]):
            return self._error(as_json, 403, TITLES[403], "You may not read this DAG.")
        repeated = _repeated()
        errors += repeated
        query = None
        if not repeated and page.query is not None:
            try:
                query = page.query.model_validate(request.args.to_dict())
            except ValidationError as exc:
                errors += _query_errors(exc)
        if errors:
            return self._refused_input(as_json, errors, page.query)
        if page.query is None and request.args:
            return self._error(
                as_json, 400, TITLES[400],
                f"{', '.join(request.args)}: not a parameter of this page; it takes none",
            )  # fmt: skip
        try:
            with open_reader(self.settings(), visibility()) as reader:
                data = page.data(reader, Airflow2Access(), query, **path)
        except pages.PageError as exc:
            return self._error(as_json, exc.status, TITLES.get(exc.status, "Error"), exc.detail)
        except InvalidInputError as exc:
            return self._error(as_json, 400, TITLES[400], str(exc))
        except ViewUnavailable as exc:
            if as_json:
                return self._json({"detail": str(exc)}, 503)
            return self._html("error.html", 503, title=exc.title, detail=exc.detail)
        if as_json:
            return self._json(data)
        return self._html(page.template, **data)

    # -- the operator's extra link -------------------------------------------------------------

    def task(self) -> Any:
        """The key a task instance's newest attempt recorded (its page), else the attempts
        of its DAG run, for the task."""
        refused = self._refusal(as_json=False)
        if refused is not None:
            return refused
        if repeated := _repeated():
            return self._refused_input(False, repeated, pages.TaskQuery)
        try:
            query = pages.TaskQuery.model_validate(request.args.to_dict())
        except ValidationError as exc:
            return self._refused_input(False, _query_errors(exc), pages.TaskQuery)
        dag_id, run_id, task_id = query.dag_id, query.run_id, query.task_id
        if not may_read_dag(dag_id):
            return self._error(False, 404, TITLES[404], "No such task instance that you may read.")
        top = f"{request.script_root}{ROUTE_BASE}"
        try:
            with open_reader(self.settings(), visibility()) as reader:
                found = _task_key(reader, dag_id, run_id, task_id, query.wanted_map_index)
        except ViewUnavailable as exc:
            return self._html("error.html", 503, title=exc.title, detail=exc.detail)
        if found is not None:
            return redirect(f"{top}/keys?" + urlencode({"job": found[0], "run_key": found[1]}))
        from urllib.parse import quote

        return redirect(
            f"{top}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}?"
            + urlencode({"task_id": task_id})
        )


def _task_key(
    reader: RecordsReader, dag_id: str, run_id: str, task_id: str, wanted: int | None
) -> tuple[str, str] | None:
    """(job, run key) of the newest attempt of the task instance (of map index ``wanted``,
    None: any), if it recorded one."""
    attempts = reader.run_attempts(dag_id, run_id, task_id).attempts
    for attempt in attempts:
        if wanted is None or attempt.get("map_index") == wanted:
            return str(attempt["job_name"]), str(attempt["run_key"])
    return None


def _path_errors(name: str, value: str) -> list[dict[str, Any]]:
    """A path parameter as Airflow 3's view checks it (.routes.checked_path)."""
    try:
        printable(value)
        if len(value) > TEXT_LIMIT:
            raise ValueError(f"longer than {TEXT_LIMIT} characters; send a shorter value")
    except ValueError as exc:
        return [{"type": "value_error", "loc": ["path", name], "msg": str(exc)}]
    return []


def _repeated() -> list[dict[str, Any]]:
    """A query parameter sent more than once, as Airflow 3's view refuses it
    (.routes.checked_query): ``to_dict`` would keep the first, FastAPI the last."""
    return [
        {"type": "value_error", "loc": ["query", name], "msg": f"sent {n} times; send it once"}
        for name, values in request.args.lists()
        if (n := len(values)) > 1
    ]


def _query_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors of a query, JSON-ready, located as FastAPI locates them."""
    return [
        {"type": e["type"], "loc": ["query", *e["loc"]], "msg": e["msg"]}
        for e in exc.errors(include_url=False, include_context=False)
    ]


FRAME_TEMPLATE = """{% extends base_template %}
{% block content %}
<iframe id="run-keys-frame" title="Run keys" src="{{ src }}" style="display:block;
        width:100%;height:calc(100vh - 170px);min-height:480px;border:0"></iframe>
{% endblock %}
"""
"""Airflow's page (its menu, messages and footer) around the view's frame."""


def appbuilder_views() -> list[dict[str, Any]]:
    """The plugin's ``appbuilder_views``: "Run keys" in the main menu."""
    return [{"name": MENU_NAME, "view": RunKeysView()}]


__all__ = ["PAGES", "RunKeysView", "appbuilder_views", "visibility"]
