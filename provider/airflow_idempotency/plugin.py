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
provider's compat module, which imports far more than a plugin may. Airflow 2.11 ignores
``fastapi_apps`` and ``external_views``: the plugin loads there and adds nothing.
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


class IdempotencyPlugin(AirflowPlugin):
    """The Run keys view: Browse > Run keys, a "Run keys" tab on every DAG and DAG run."""

    name = "idempotency"
    fastapi_apps = [{"app": _LazyApp(), "url_prefix": MOUNT, "name": "Run keys"}]
    # Relative hrefs resolve against the UI's <base href>, so they follow [api] base_url.
    external_views = [
        {
            "name": "Run keys",
            "href": f"{MOUNT.lstrip('/')}/",
            "url_route": NAV_ROUTE,
            "destination": "nav",
            "category": "browse",
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
