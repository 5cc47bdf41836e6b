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
- ``/locks`` — the run locks held now: holder (host, pid, attempt, DAG run) and age.

Authentication and authorization are Airflow's (:mod:`.dependencies`). Reruns are triggered
by the page itself through Airflow's REST API with the user's own session, so Airflow
decides who may. The app only reads: one read-only transaction per page.
"""

from __future__ import annotations

from fastapi import FastAPI

from airflow_idempotency.ui.errors import register_error_handlers
from airflow_idempotency.ui.routes import router
from airflow_idempotency.ui.settings import Settings


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app (``settings``: from Airflow's configuration unless given)."""
    app = FastAPI(title="Run keys", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings = settings or Settings.from_airflow_config()
    app.include_router(router)
    register_error_handlers(app)
    return app


__all__ = ["Settings", "create_app"]
