"""The operator's extra link "Run key": the task's run key in the Run keys view.

Airflow 3: the worker computes an operator's extra links when the task ends and stores each
as an XCom; the UI shows them on the task instance's Details tab. The link opens the key's
page inside Airflow's own page (``/plugin/run-keys/...``): the (job, run key) this execution
recorded, or, when it failed before resolving its key, the task's attempts in the DAG run's
tab.

Airflow 2.11: the webserver computes the link when it shows the task instance, from the
serialized operator (which does not know the key), so the link is the view's
``/runkeys/task`` page, which finds the key the task's newest attempt recorded.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS, BaseOperatorLink
from airflow_idempotency.ui import AIRFLOW2_ROUTE, MOUNT, NAV_ROUTE

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


def airflow2_task_url(
    *, dag_id: str, run_id: str, task_id: str, map_index: int, base_url: str | None
) -> str:
    """The path of a task's Run key page on Airflow 2.11, under ``[webserver] base_url``'s."""
    base = urlsplit(base_url or "").path.rstrip("/")
    params = {"dag_id": dag_id, "run_id": run_id, "task_id": task_id}
    if map_index >= 0:
        params["map_index"] = str(map_index)
    return f"{base}{AIRFLOW2_ROUTE}/task?" + urlencode(params)


class RunKeyLink(BaseOperatorLink):
    """ "Run key": this task's run key in the Run keys view."""

    name = "Run key"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.configuration import conf

        if not AIRFLOW_V_3_0_PLUS:
            return airflow2_task_url(
                dag_id=ti_key.dag_id,
                run_id=ti_key.run_id,
                task_id=ti_key.task_id,
                map_index=int(getattr(ti_key, "map_index", -1)),
                base_url=conf.get("webserver", "base_url", fallback=None),
            )
        return run_key_url(
            dag_id=ti_key.dag_id,
            run_id=ti_key.run_id,
            task_id=ti_key.task_id,
            target=getattr(operator, LINK_TARGET_ATTRIBUTE, None),
            base_url=conf.get("api", "base_url", fallback=None),
        )


def run_key_links() -> tuple[BaseOperatorLink, ...]:
    """The operator's extra links: "Run key", on both lines.

    Airflow 3's worker computes it when the task ends; Airflow 2.11's webserver computes it
    when the task is shown, and finds its class among the plugin's ``operator_extra_links``
    to deserialize the DAG (links.py, plugin.py).
    """
    return (RunKeyLink(),)
