"""The DAG of the notification tests (tests/integration/test_notifications.py and
tests/stack/test_notifications_stack.py): an idempotent task that succeeds, or fails when the
run's conf says ``"fail": true``, notified by email (Airflow's SmtpNotifier, connection
``smtp_notify``) and by a plain callback posting to a local webhook (``NOTIFY_WEBHOOK_URL``),
each once per (job, run key, event) through notify_once. A second task's success is also
notified by a callback that raises."""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

import httpx
import pendulum
from airflow.providers.common.compat.sdk import DAG, task
from airflow.providers.smtp.notifications.smtp import SmtpNotifier

from airflow_idempotency import RunContext, idempotency_params
from airflow_idempotency.effects.notifications import notify_once


def _post(context: Any, event: str) -> None:
    ti = context["ti"]
    body = {"event": event, "task_id": ti.task_id, "run_id": context["run_id"]}
    httpx.post(os.environ["NOTIFY_WEBHOOK_URL"], json=body, timeout=5).raise_for_status()


def webhook_success(context: Any) -> None:
    _post(context, "success")


def webhook_failure(context: Any) -> None:
    _post(context, "failure")


def chat_is_down(context: Any) -> None:
    raise RuntimeError("the chat service answered 500")


def mail(event: str) -> SmtpNotifier:
    return SmtpNotifier(
        to="ops@example.com",
        from_email="airflow@example.com",
        subject=f"{{{{ ti.task_id }}}}: {event}",
        html_content="<p>{{ run_id }}</p>",
        smtp_conn_id="smtp_notify",
    )


def build(dag_id: str) -> DAG:
    with DAG(
        dag_id,
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        params=idempotency_params(),
    ) as dag:
        # [START notify_once]
        @task.idempotent_run(
            job_name=f"{dag_id}.work",
            retries=1,
            retry_delay=dt.timedelta(seconds=1),
            on_success_callback=notify_once(mail("success"), webhook_success, event="success"),
            on_failure_callback=notify_once(mail("failure"), webhook_failure, event="failure"),
        )
        def work(run: RunContext) -> dict[str, int]:
            if (run.airflow_context["dag_run"].conf or {}).get("fail"):
                raise RuntimeError("the work failed")
            return {"done": 1}

        # [END notify_once]

        @task.idempotent_run(
            job_name=f"{dag_id}.other",
            on_success_callback=notify_once(chat_is_down, mail("other"), event="success"),
        )
        def other(run: RunContext) -> dict[str, int]:
            return {"done": 1}

        # mypy reads Airflow's TaskFlow typing: it does not know the operator passes the RunContext.
        work() >> other()  # type: ignore[call-arg, misc]
    return dag


dag = build("notify_effects")
