"""The operator's extra link "Run key" (Airflow 3): the task's run key in the Run keys view.

On Airflow 3 the worker computes an operator's extra links when the task ends and stores
each as an XCom; the UI shows them on the task instance's Details tab. The link opens the
key's page inside Airflow's own page (``/plugin/run-keys/...``): the (job, run key) this
execution recorded, or, when it failed before resolving its key, the task's attempts in the
DAG run's tab. Airflow 2.11 gets no link (its UI has no Run keys view): see
:func:`airflow_idempotency.compat.run_key_links`.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from airflow_idempotency.compat import BaseOperatorLink
from airflow_idempotency.ui import MOUNT, NAV_ROUTE

LINK_TARGET_ATTRIBUTE = "run_key_link_target"
"""Set by the operator on itself while it executes: ``(job_name, run_key)``."""


def run_key_url(
    *,
    dag_id: str,
    run_id: str,
    task_id: str,
    target: tuple[str, str] | None,
    base_url: str | None,
) -> str:
    """The path of a task's Run key page, under ``[api] base_url``'s path."""
    base = urlsplit(base_url or "").path.rstrip("/")
    if target is not None:
        page = f"{MOUNT}/keys?" + urlencode({"job": target[0], "run_key": target[1]})
    else:
        page = f"{MOUNT}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}?" + urlencode(
            {"task_id": task_id}
        )
    return f"{base}/plugin/{NAV_ROUTE}{page}"


class RunKeyLink(BaseOperatorLink):
    """ "Run key": this task's run key in the Run keys view."""

    name = "Run key"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.configuration import conf

        return run_key_url(
            dag_id=ti_key.dag_id,
            run_id=ti_key.run_id,
            task_id=ti_key.task_id,
            target=getattr(operator, LINK_TARGET_ATTRIBUTE, None),
            base_url=conf.get("api", "base_url", fallback=None),
        )
