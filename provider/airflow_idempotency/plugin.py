"""The Airflow plugin of the Run keys view (entry point ``airflow.plugins``).

Airflow imports this module and instantiates :class:`IdempotencyPlugin` in every process
that loads plugins, every task process included (3.x integrates macro plugins before each
task runs). So it imports nothing but the plugin base class: the FastAPI app, psycopg and
the templates are loaded by the api-server on the first request to ``/idempotency``
(:class:`_LazyApp`). ``python3 dev.py bench --only ui`` measures what it adds to a task
process (BENCHMARKS.md).

The base class comes from common-compat, as official providers take it: the Task SDK's on
Airflow 3 (already loaded in a task process; the core plugin manager accepts it too, it
recognises the base by name), ``airflow.plugins_manager``'s on 2.11. Not through this
provider's compat module, which imports far more than a plugin may.

Airflow 2.11 ignores ``fastapi_apps`` and ``external_views``; its webserver asks for
``appbuilder_views`` (the Flask AppBuilder view of :mod:`airflow_idempotency.ui.fab`, "Run
keys" in the main menu) and ``operator_extra_links`` (the "Run key" link's class, which it
must know to deserialize the operator's DAGs). Both are properties that import what they
need when they are read, which only the webserver and the scheduler do; on Airflow 3 they
are empty (an Airflow 3 api-server would need the FAB provider to serve Flask views).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from airflow.providers.common.compat.sdk import AirflowPlugin

from airflow_idempotency.ui import MOUNT, NAV_ROUTE

_Scope = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class _LazyApp:
    """An ASGI app that builds the real one (:func:`airflow_idempotency.ui.app.create_app`)
    on its first request, so that loading the plugin imports nothing heavy.

    The build is synchronous code on the event loop (no ``await`` inside), so requests
    arriving together still build it once. The api-server enters the lifespan of mounted
    FastAPI apps only; the real app needs none.
    """

    def __init__(self) -> None:
        self._app: Callable[[_Scope, _Receive, _Send], Awaitable[None]] | None = None

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if self._app is None:
            from airflow_idempotency.ui.app import create_app

            self._app = create_app()
        await self._app(scope, receive, send)


def _key_icon(colour: str, halo: str) -> str:
    """A key, as a data URI the UI's nav shows as the entry's icon (no request, no auth):
    drawn in ``colour`` over a ``halo``, so that it shows on the nav and on its highlight."""
    shape = "<circle cx='7.5' cy='15.5' r='4.5'/><path d='M10.7 12.3 21 2M16 7l3 3M14 9l2 2'/>"
    svg = (
        "<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 24 24' fill='none' "
        "stroke-linecap='round' stroke-linejoin='round'>"
        f"<g stroke='{halo}' stroke-width='4'>{shape}</g>"
        f"<g stroke='{colour}' stroke-width='2'>{shape}</g></svg>"
    )
    return "data:image/svg+xml," + svg.replace("<", "%3C").replace(">", "%3E").replace("#", "%23")


class IdempotencyPlugin(AirflowPlugin):
    """The Run keys view: "Run keys" in the main navigation, a "Run keys" tab on every DAG
    and DAG run."""

    name = "idempotency"
    fastapi_apps = [{"app": _LazyApp(), "url_prefix": MOUNT, "name": "Run keys"}]
    # Relative hrefs resolve against the UI's <base href>, so they follow [api] base_url.
    external_views = [
        {
            "name": "Run keys",
            "href": f"{MOUNT.lstrip('/')}/",
            "url_route": NAV_ROUTE,
            "destination": "nav",
            # Airflow 3.1+'s nav shows a top-level entry with its icon (else under a menu).
            "nav_top_level": True,
            "icon": _key_icon("#2d3748", "#ffffff"),
            "icon_dark_mode": _key_icon("#e2e8f0", "#1a202c"),
        },
        {
            "name": "Run keys",
            "href": f"{MOUNT.lstrip('/')}/dags/{{DAG_ID}}",
            "url_route": "run-keys-dag",
            "destination": "dag",
        },
        {
            "name": "Run keys",
            "href": f"{MOUNT.lstrip('/')}/dags/{{DAG_ID}}/runs/{{RUN_ID}}",
            "url_route": "run-keys-run",
            "destination": "dag_run",
        },
    ]

    @property
    def appbuilder_views(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Airflow 2.11's webserver: "Run keys" in the main menu (none on Airflow 3)."""
        from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS

        if AIRFLOW_V_3_0_PLUS:
            return []
        from airflow_idempotency.ui.fab import appbuilder_views

        return appbuilder_views()

    @property
    def operator_extra_links(self) -> list[Any]:  # type: ignore[override]
        """Airflow 2.11: the "Run key" link, registered for DAG deserialization (Airflow 3
        finds it on the operator: the worker computes its links)."""
        from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS

        if AIRFLOW_V_3_0_PLUS:
            return []
        from airflow_idempotency.links import RunKeyLink

        return [RunKeyLink()]
