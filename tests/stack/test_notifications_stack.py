"""notify_once on a real Airflow 3 stack (scheduler, api-server, dag-processor; the callbacks
run in the task processes): a success and a failure are each notified once per run key, by
email to a real SMTP server and by a webhook, through retries, a Clear and reruns."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from devtools import airflow_env
from devtools.airflow_stack import AirflowStack, airflow_stack
from devtools.smtp_server import SmtpServer, smtp_connection_env
from support import TESTS
from support.effects import Webhook

DAGS = TESTS / "dags_effects"
DAG_ID = "notify_effects"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, pg_server: Any
) -> Iterator[tuple[AirflowStack, SmtpServer, Webhook, str]]:
    """One stack, SMTP server, webhook and job database for the whole module."""
    from devtools.postgres import temporary_database

    smtp = SmtpServer(tmp_path_factory.mktemp("stack-mail"))
    smtp.start()
    hook = Webhook()
    with temporary_database(pg_server, "idem_notify") as dsn:
        env = {
            **airflow_env.connection_env(dsn),
            "NOTIFY_WEBHOOK_URL": hook.url,
            **smtp_connection_env(smtp, "smtp_notify"),
        }
        home = tmp_path_factory.mktemp("stack") / "home"
        try:
            with airflow_stack(home, DAGS, env, start_timeout=300) as stack:
                stack.unpause(DAG_ID, timeout=300)
                yield stack, smtp, hook, dsn
        finally:
            hook.server.shutdown()
            smtp.kill()


def mails(smtp: SmtpServer) -> Counter[str]:
    return smtp.deliveries_by_key()


def clear_task(stack: AirflowStack, run_id: str, task_id: str, timeout: float = 180) -> None:
    """Clear one task of a run through the REST API and wait until it ran again."""
    before = {t.task_id: t.try_number for t in stack.task_instances(DAG_ID, run_id)}[task_id]
    stack.api(
        "POST",
        f"/api/v2/dags/{DAG_ID}/clearTaskInstances",
        {"dag_run_id": run_id, "task_ids": [task_id], "dry_run": False, "only_failed": False},
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tis = {t.task_id: t for t in stack.task_instances(DAG_ID, run_id)}
        ti = tis[task_id]
        if ti.try_number > before and ti.state in ("success", "failed"):
            run = stack.dag_run(DAG_ID, run_id)
            if run is not None and run.state in ("success", "failed"):
                return
        time.sleep(1)
    raise AssertionError(f"{task_id} of {run_id} did not run again in {timeout} s")


def test_success_notified_once_through_clear_and_rerun(
    world: tuple[AirflowStack, SmtpServer, Webhook, str],
) -> None:
    """The first run notifies once by email and webhook; Clearing its task (a no-op rerun) and triggering the key again notify nothing more."""
    stack, smtp, hook, _ = world
    first = stack.trigger(DAG_ID, conf={"run_key": "2026-10-01"}, timeout=300)
    assert first.state == "success", stack.describe_runs(DAG_ID, [first.run_id])
    key = f"{DAG_ID}.work:2026-10-01:success"
    assert mails(smtp)[key] == 1
    assert hook.events(first.run_id)[("work", "success")] == 1
    clear_task(stack, first.run_id, "work")
    again = stack.trigger(DAG_ID, conf={"run_key": "2026-10-01"}, timeout=300)
    assert again.state == "success"
    assert mails(smtp)[key] == 1
    assert hook.events()[("work", "success")] == 1


def test_failure_notified_once_through_retries_and_reruns(
    world: tuple[AirflowStack, SmtpServer, Webhook, str],
) -> None:
    """A key that fails after its retry notifies its failure once; the same key failing in a later run does not notify again."""
    stack, smtp, hook, _ = world
    conf = {"run_key": "2026-10-02", "fail": True}
    first = stack.trigger(DAG_ID, conf=conf, timeout=300)
    assert first.state == "failed"
    [work] = [t for t in stack.task_instances(DAG_ID, first.run_id) if t.task_id == "work"]
    assert work.try_number == 2  # the retry ran, and notified nothing
    key = f"{DAG_ID}.work:2026-10-02:failure"
    assert mails(smtp)[key] == 1
    assert hook.events(first.run_id) == Counter({("work", "failure"): 1})
    second = stack.trigger(DAG_ID, conf=conf, timeout=300)
    assert second.state == "failed"
    assert mails(smtp)[key] == 1
    assert hook.events(second.run_id) == Counter()
