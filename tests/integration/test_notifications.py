"""Task callbacks through notify_once, on Airflow's real dag.test() path (both lines), against a
real SMTP server (Airflow's own SmtpNotifier) and a local HTTP webhook (a plain callback): one
notification per (job, run key, event), whatever the retries, reruns and no-ops."""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_idempotency.effects.mail import message_id
from airflow_idempotency.schema import DEFAULT_SCHEMA, ensure_schema
from devtools.smtp_server import SmtpServer, smtp_connection_env
from support import TESTS
from support.dag_runs import FAILED, SUCCESS, run_dag, task_states
from support.effects import Webhook, ledger

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]

DAG_FILE = TESTS / "dags_effects" / "notify_effects.py"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SmtpServer, Webhook]]:
    """One SMTP server and one webhook for the module (each test uses its own run keys)."""
    smtp = SmtpServer(tmp_path_factory.mktemp("notify-mail"))
    smtp.start()
    hook = Webhook()
    yield smtp, hook
    hook.server.shutdown()
    smtp.kill()


@pytest.fixture
def dag(
    airflow_pg_conn: str, servers: tuple[SmtpServer, Webhook], monkeypatch: pytest.MonkeyPatch
) -> Any:
    smtp, hook = servers
    for name, value in smtp_connection_env(smtp, "smtp_notify").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NOTIFY_WEBHOOK_URL", hook.url)
    spec = importlib.util.spec_from_file_location("notify_effects_dag", DAG_FILE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build("notify_effects")


def mails(smtp: SmtpServer, run_key: str) -> Counter[str]:
    """Deliveries per effect key (job:run_key:event) of one run key."""
    return Counter(k for k in smtp.deliveries_by_key().elements() if f":{run_key}:" in k)


def test_success_is_notified_once_across_reruns(
    dag: Any, airflow_pg_conn: str, servers: tuple[SmtpServer, Webhook]
) -> None:
    """The first run notifies by email and webhook; a no-op rerun and a forced recompute of the same key notify nothing more, and the no-op writes no ledger row."""
    smtp, hook = servers
    first = run_dag(dag, conf={"run_key": "2026-10-01"})
    assert first.state == SUCCESS, task_states(first)
    key = "notify_effects.work:2026-10-01:success"
    assert mails(smtp, "2026-10-01")[key] == 1
    assert hook.events(first.run_id)[("work", "success")] == 1
    rows = ledger(airflow_pg_conn)
    assert {r[1] for r in rows.values()} == {"notification"}

    noop = run_dag(dag, conf={"run_key": "2026-10-01"})
    assert noop.state == SUCCESS
    assert ledger(airflow_pg_conn) == rows
    forced = run_dag(dag, conf={"run_key": "2026-10-01", "force": True})
    assert forced.state == SUCCESS
    assert mails(smtp, "2026-10-01")[key] == 1
    assert hook.events(noop.run_id) == Counter() and hook.events(forced.run_id) == Counter()
    assert [d["message_id"] for d in smtp.deliveries() if d["key"] == key] == [
        message_id(key, "airflow.notification")
    ]


def test_failure_is_notified_once_not_per_retry_or_rerun(
    dag: Any, airflow_pg_conn: str, servers: tuple[SmtpServer, Webhook]
) -> None:
    """A task failing after its retry notifies its failure once; the same key failing again in another run does not notify again."""
    smtp, hook = servers
    conf = {"run_key": "2026-10-02", "fail": True}
    first = run_dag(dag, conf=conf)
    assert first.state == FAILED
    key = "notify_effects.work:2026-10-02:failure"
    assert mails(smtp, "2026-10-02") == Counter({key: 1})
    assert hook.events(first.run_id) == Counter({("work", "failure"): 1})
    again = run_dag(dag, conf=conf)
    assert again.state == FAILED
    assert mails(smtp, "2026-10-02") == Counter({key: 1})
    assert hook.events(again.run_id) == Counter()
    assert ledger(airflow_pg_conn)[key][0] == "succeeded"


def test_a_raising_notifier_is_named_and_loses_nothing_else(
    dag: Any, airflow_pg_conn: str, servers: tuple[SmtpServer, Webhook]
) -> None:
    """A callback that raises is recorded unknown with its error; the email of the same callback is still sent, the task still succeeds, and a forced rerun calls neither again."""
    smtp, _ = servers
    run = run_dag(dag, conf={"run_key": "2026-10-03"})
    assert run.state == SUCCESS, task_states(run)
    key = "notify_effects.other:2026-10-03:success"
    with psycopg.connect(airflow_pg_conn) as conn:
        by_remote: dict[str, Any] = dict(
            conn.execute(
                "SELECT remote_system, status FROM idempotency.outbound_ledger"
                " WHERE idempotency_key = %s",
                (key,),
            ).fetchall()
        )
        error = conn.execute(
            "SELECT last_error FROM idempotency.outbound_ledger"
            " WHERE idempotency_key = %s AND remote_system = 'notify:chat_is_down'",
            (key,),
        ).fetchone()
    assert by_remote == {"notify:chat_is_down": "unknown", "notify:SmtpNotifier": "succeeded"}
    assert error and "RuntimeError: the chat service answered 500" in error[0]
    assert mails(smtp, "2026-10-03")[key] == 1
    run_dag(dag, conf={"run_key": "2026-10-03", "force": True})
    assert mails(smtp, "2026-10-03")[key] == 1


def test_a_resent_success_notification_of_a_completed_key_is_delivered(
    dag: Any, airflow_pg_conn: str, servers: tuple[SmtpServer, Webhook]
) -> None:
    """An operator's resend of a completed key's success notification (its answer lost: unknown) is delivered by the next run of the key, a no-op, once; the run after it sends nothing."""
    from airflow_idempotency.effects.resolutions import resolve_unknown

    smtp, hook = servers
    first = run_dag(dag, conf={"run_key": "2026-10-05"})
    assert first.state == SUCCESS, task_states(first)
    key = "notify_effects.work:2026-10-05:success"
    with psycopg.connect(airflow_pg_conn, autocommit=True) as conn:
        remotes = [r for (r,) in conn.execute(
            "UPDATE idempotency.outbound_ledger SET status = 'unknown', intent_at = now()"
            " - interval '1 hour' WHERE idempotency_key = %s RETURNING remote_system", (key,),
        )]  # fmt: skip
        assert len(remotes) == 2  # the email and the webhook
        for remote in remotes:
            resolve_unknown(conn, "idempotency", remote_system=remote, idempotency_key=key,
                            action="resend", resolved_by="ann", reason="not received")  # fmt: skip
    noop = run_dag(dag, conf={"run_key": "2026-10-05"})
    assert noop.state == SUCCESS, task_states(noop)
    assert mails(smtp, "2026-10-05")[key] == 2
    assert hook.events(noop.run_id)[("work", "success")] == 1
    with psycopg.connect(airflow_pg_conn) as conn:
        after = conn.execute(
            "SELECT status FROM idempotency.outbound_ledger WHERE idempotency_key = %s", (key,)
        ).fetchall()
    assert after == [("succeeded",), ("succeeded",)]
    again = run_dag(dag, conf={"run_key": "2026-10-05"})
    assert mails(smtp, "2026-10-05")[key] == 2 and hook.events(again.run_id) == Counter()


def test_a_failing_dry_run_notifies_nothing(
    dag: Any, airflow_pg_conn: str, servers: tuple[SmtpServer, Webhook]
) -> None:
    """A dry run whose work fails notifies nothing (no failure email, no webhook) and writes no ledger row."""
    smtp, hook = servers
    dry = run_dag(dag, conf={"run_key": "2026-10-06", "fail": True, "dry_run": True})
    assert dry.state == FAILED
    assert mails(smtp, "2026-10-06") == Counter()
    assert hook.events(dry.run_id) == Counter()
    assert not [k for k in ledger(airflow_pg_conn) if ":2026-10-06:" in k]


def test_a_dry_run_refused_before_its_work_notifies_nothing(
    dag: Any, airflow_pg_conn: str, servers: tuple[SmtpServer, Webhook]
) -> None:
    """A dry run refused before its work starts (its run key names a day that has not ended)
    notifies nothing either, and writes no ledger row (adversary, issue 30)."""
    smtp, hook = servers
    with psycopg.connect(airflow_pg_conn, autocommit=True) as conn:
        ensure_schema(conn, DEFAULT_SCHEMA)  # the ledger's table, read below
    dry = run_dag(dag, conf={"run_key": "2099-01-01", "dry_run": True})
    assert dry.state == FAILED
    assert hook.events(dry.run_id) == Counter()
    assert not [k for k in smtp.deliveries_by_key().elements() if dry.run_id in k]
    assert not [k for k in ledger(airflow_pg_conn) if dry.run_id in k or "2099-01-01" in k]
