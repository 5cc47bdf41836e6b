"""Email through the ledger against a real SMTP server (aiosmtpd, its own process), which
counts every message it delivers: no message twice, none lost, across kills and reruns."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_idempotency import OutboundLedger, RunContext
from airflow_idempotency.effects.mail import (
    Recipients,
    SmtpSecurity,
    SmtpSender,
    email_effect,
    message_id,
)
from airflow_idempotency.effects.resolutions import (
    IN_FLIGHT_BOUND,
    Action,
    resolutions,
    resolve_unknown,
)
from airflow_idempotency.exceptions import (
    EffectsUnknownError,
    IdempotencyKeyConflictError,
    InvalidEffectError,
    LockLostError,
    RemoteCallError,
    RunLockedError,
)
from airflow_idempotency.ledger import Retries
from airflow_idempotency.ledger.pipeline import INTENTS_AHEAD
from devtools.smtp_server import SmtpServer, smtp_connection_env
from support.effects import crashed_worker, ledger, run_once, statuses
from support.locks import terminate_lock_session

KEYS = "job:2026-10-01:mail_"


def emails(n: int, body: str = "body") -> list[Any]:
    return [
        email_effect(
            f"{KEYS}{i}", to=f"user{i}@example.com", subject=f"message {i}", text=f"{body} {i}"
        )
        for i in range(n)
    ]


@pytest.fixture
def smtp(tmp_path: Path) -> Iterator[SmtpServer]:
    """A real SMTP server process; killed after the test."""
    server = SmtpServer(tmp_path / "mail")
    server.start()
    yield server
    server.kill()


def send(dsn: str, server: SmtpServer, items: Any, **options: Any) -> Any:
    """One idempotent run sending ``items`` to ``server``; its summary, or the error it raised."""
    out: dict[str, Any] = {}
    concurrency = options.pop("concurrency", 4)

    def work(run: RunContext) -> dict[str, int]:
        sender = SmtpSender(
            host="127.0.0.1", port=server.port, from_email="jobs@example.com",
            concurrency=concurrency, timeout=5,
        )  # fmt: skip
        retries = Retries(options.pop("max_attempts", 5), backoff_initial=0.01, backoff_max=0.05)
        ledger_ = OutboundLedger(run, "smtp", retries=retries, unreachable_after=1, **options)
        try:
            summary = out["summary"] = ledger_.send_all(items, sender)
        except Exception as exc:
            out["error"] = exc
            raise
        return summary.as_counts("mail")

    try:
        run_once(dsn, work, force=True)
    except Exception:
        assert "error" in out, "the run failed outside the ledger"
    return out.get("summary") or out["error"]


def operator_resolves(dsn: str, server: SmtpServer) -> dict[str, Action]:
    """What an operator does with each unknown effect: look for its Message-ID at the server;
    mark it sent if it is there, resend it if not. Returns key -> action."""
    delivered = {d["message_id"] for d in server.deliveries()}
    actions = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for key, status in statuses(dsn, "smtp").items():
            if status != "unknown":
                continue
            action: Action = (
                "mark_sent" if message_id(key, "example.com") in delivered else "resend"
            )
            resolve_unknown(
                conn, "idempotency", remote_system="smtp", idempotency_key=key,
                action=action, resolved_by="oncall", reason="checked the mailbox",
            )  # fmt: skip
            actions[key] = action
    return actions


def in_flight_bound_passes(dsn: str, server: SmtpServer) -> None:
    """A killed worker cannot be told from a paused one that may still be inside a call: the
    operator's resolution is refused until IN_FLIGHT_BOUND after the call began (issue 30);
    then that much time passes (the intents are aged by as much)."""
    with pytest.raises(RunLockedError, match="may still be in flight"):
        operator_resolves(dsn, server)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE idempotency.outbound_ledger SET intent_at = intent_at"
            " - make_interval(secs => %s) WHERE status = 'unknown'",
            (IN_FLIGHT_BOUND,),
        )


def test_one_message_per_key_with_a_stable_message_id(pg_dsn: str, smtp: SmtpServer) -> None:
    """Each effect is delivered once with a Message-ID derived from its key; a rerun delivers nothing and writes nothing."""
    first = send(pg_dsn, smtp, emails(25), batch_size=10)
    assert (first.sent, first.total, first.unknown) == (25, 25, 0)
    delivered = smtp.deliveries()
    assert smtp.deliveries_by_key() == {f"{KEYS}{i}": 1 for i in range(25)}
    assert {d["message_id"] for d in delivered} == {
        message_id(f"{KEYS}{i}", "example.com") for i in range(25)
    }
    assert {d["to"][0] for d in delivered} == {f"user{i}@example.com" for i in range(25)}
    rows = ledger(pg_dsn, "smtp")
    assert {(status, kind, dedup, calls) for status, kind, dedup, calls, _ in rows.values()} == {
        ("succeeded", "email", False, 1)
    }
    again = send(pg_dsn, smtp, emails(25), batch_size=10)
    assert (again.sent, again.skipped_existing) == (0, 25)
    assert len(smtp.deliveries()) == 25


def test_a_changed_message_under_a_sent_key_is_refused(pg_dsn: str, smtp: SmtpServer) -> None:
    """Another body under a key already sent is refused like a changed request: nothing is delivered."""
    send(pg_dsn, smtp, emails(3))
    error = send(pg_dsn, smtp, emails(3, body="corrected"))
    assert isinstance(error, IdempotencyKeyConflictError) and "different request" in str(error)
    assert len(smtp.deliveries()) == 3


@pytest.mark.parametrize("batch_size", [10, 40])
@pytest.mark.parametrize("how", ["dies after storing a message", "SIGKILL from outside"])
def test_server_killed_mid_batch_then_rerun_converges(
    pg_dsn: str, smtp: SmtpServer, how: str, batch_size: int
) -> None:
    """The SMTP server dies mid-batch (batches of 10, or all 40 messages pipelined in one): what it may have delivered is unknown and never resent on its own, the rest is sent by the rerun, and after the operator's choices every message was delivered exactly once."""
    n = 40
    if how == "dies after storing a message":
        smtp.kill()
        smtp.start(die_after=15)
    else:

        def killer() -> None:
            deadline = time.monotonic() + 60
            while len(smtp.deliveries()) < 15 and time.monotonic() < deadline:
                time.sleep(0.005)
            smtp.kill()

        threading.Thread(target=killer, daemon=True).start()
    first = send(pg_dsn, smtp, emails(n), batch_size=batch_size, max_attempts=2)
    assert isinstance(first, RemoteCallError)
    smtp.wait_dead(30)
    after_kill = smtp.deliveries_by_key()
    assert max(after_kill.values()) == 1 and 0 < len(after_kill) < n
    unknown = {k for k, s in statuses(pg_dsn, "smtp").items() if s == "unknown"}
    confirmed = {k for k, s in statuses(pg_dsn, "smtp").items() if s == "succeeded"}
    assert confirmed <= set(after_kill)  # nothing confirmed that the server did not take
    assert set(after_kill) <= confirmed | unknown  # nothing delivered is thought unsent

    if how == "dies after storing a message":  # the 15th stored, then it died unanswered
        assert smtp.deliveries()[14]["key"] in unknown
    smtp.start()
    second = send(pg_dsn, smtp, emails(n), batch_size=10)
    assert all(count == 1 for count in smtp.deliveries_by_key().values())
    assert set(smtp.deliveries_by_key()) | unknown == {f"{KEYS}{i}" for i in range(n)}
    if unknown:  # a kill between two messages leaves none (possible from outside only)
        assert isinstance(second, EffectsUnknownError)
        assert f"{len(unknown)} effect(s) of 'smtp' are unknown" in str(second)
        actions = operator_resolves(pg_dsn, smtp)
        assert set(actions) == unknown
        third = send(pg_dsn, smtp, emails(n), batch_size=10)
        assert third.sent == sum(a == "resend" for a in actions.values()) and third.ok
    else:
        assert second.ok
    assert smtp.deliveries_by_key() == {f"{KEYS}{i}": 1 for i in range(n)}
    assert set(statuses(pg_dsn, "smtp").values()) == {"succeeded"}


def test_worker_killed_between_intent_and_outcome_leaves_it_unknown(
    pg_dsn: str, smtp: SmtpServer
) -> None:
    """A worker SIGKILLed right after the server accepted a message, before the outcome was written: the message is unknown, the rerun does not send it again, and every other message is delivered once."""
    proc = crashed_worker("ledger.after_remote_commit@7", "mail", pg_dsn, str(smtp.port), "30")
    assert proc.returncode == -9, proc.stderr[-2000:]
    state = statuses(pg_dsn, "smtp")
    unknown = {k for k, s in state.items() if s == "unknown"}
    confirmed = {k for k, s in state.items() if s == "succeeded"}
    delivered = set(smtp.deliveries_by_key())
    # the 7th confirmation was lost with the worker: delivered, unknown; so are the outcomes
    # not yet written and the calls granted (at most the batch of 10 here)
    assert len(confirmed) <= 6 and confirmed <= delivered <= confirmed | unknown
    assert len(delivered) >= 7 and 1 <= len(unknown) <= 10 and unknown & delivered
    rerun = send(pg_dsn, smtp, emails(30), batch_size=10)
    assert isinstance(rerun, EffectsUnknownError)
    in_flight_bound_passes(pg_dsn, smtp)
    assert all(n == 1 for n in smtp.deliveries_by_key().values())
    assert set(smtp.deliveries_by_key()) | unknown == {f"{KEYS}{i}" for i in range(30)}
    assert {k for k, s in statuses(pg_dsn, "smtp").items() if s == "unknown"} == unknown
    operator_resolves(pg_dsn, smtp)
    assert send(pg_dsn, smtp, emails(30), batch_size=10).ok
    assert smtp.deliveries_by_key() == {f"{KEYS}{i}": 1 for i in range(30)}


@pytest.mark.parametrize(
    "point",
    ["ledger.after_remote_commit@120", "ledger.after_intent@120", "ledger.before_remote_call@120"],
)
def test_a_crash_mid_pipeline_leaves_at_most_the_bound_unknown(
    pg_dsn: str, smtp: SmtpServer, point: str
) -> None:
    """A worker SIGKILLed in the middle of one pipelined batch (200 messages, 4 connections): at most concurrency + INTENTS_AHEAD effects are unknown, nothing unknown is sent again, nothing delivered is thought unsent, and after the operator's choices every message was delivered exactly once."""
    n, concurrency = 200, 4
    proc = crashed_worker(point, "mail", pg_dsn, str(smtp.port), str(n), "500", str(concurrency))
    assert proc.returncode == -9, proc.stderr[-2000:]
    state = statuses(pg_dsn, "smtp")
    unknown = {k for k, s in state.items() if s == "unknown"}
    confirmed = {k for k, s in state.items() if s == "succeeded"}
    delivered = smtp.deliveries_by_key()
    assert len(state) == n and set(state.values()) <= {"succeeded", "unknown", "pending"}
    assert max(delivered.values()) == 1
    assert confirmed <= set(delivered) <= confirmed | unknown
    assert 1 <= len(unknown) <= concurrency + INTENTS_AHEAD, len(unknown)
    assert len(confirmed) < 120 <= len(confirmed) + len(unknown)  # 120 intents committed at least
    rerun = send(pg_dsn, smtp, emails(n), batch_size=500)
    assert isinstance(rerun, EffectsUnknownError)
    in_flight_bound_passes(pg_dsn, smtp)
    assert max(smtp.deliveries_by_key().values()) == 1
    assert set(smtp.deliveries_by_key()) | unknown == {f"{KEYS}{i}" for i in range(n)}
    operator_resolves(pg_dsn, smtp)
    assert send(pg_dsn, smtp, emails(n), batch_size=500).ok
    assert smtp.deliveries_by_key() == {f"{KEYS}{i}": 1 for i in range(n)}


def test_the_lock_lost_mid_batch_stops_the_calls_and_keeps_the_outcomes(
    pg_dsn: str, smtp: SmtpServer
) -> None:
    """The run's lock session ends in the middle of a pipelined batch: no intent commits after that, so no call begins beyond the intents already granted (at most concurrency + INTENTS_AHEAD), the outcomes received are written, the rest stays pending, and the next run delivers it: nothing twice, nothing lost."""
    n, concurrency = 300, 4
    # Each answer takes 20 ms (300 messages: about 1.5 s at this concurrency), so that the lock
    # session ends mid-batch however loaded the machine is: an instant server let a slow
    # killer thread see the whole batch delivered first.
    smtp.kill()
    smtp.start(delay=0.02)

    def end_the_lock() -> None:
        deadline = time.monotonic() + 60
        while len(smtp.deliveries()) < 60 and time.monotonic() < deadline:
            time.sleep(0.002)
        ended.append(len(smtp.deliveries()))
        terminate_lock_session(pg_dsn, "job", "2026-10-01")
        ended.append(len(smtp.deliveries()))

    ended: list[int] = []  # deliveries when the lock session is ended, and once it is gone
    killer = threading.Thread(target=end_the_lock, daemon=True)
    killer.start()
    first = send(pg_dsn, smtp, emails(n), batch_size=500, concurrency=concurrency)
    killer.join(30)
    assert isinstance(first, LockLostError), first
    state = statuses(pg_dsn, "smtp")
    delivered = smtp.deliveries_by_key()
    confirmed = {k for k, s in state.items() if s == "succeeded"}
    unknown = {k for k, s in state.items() if s == "unknown"}
    assert max(delivered.values()) == 1 and set(delivered) == confirmed
    assert not unknown  # every call that began had its outcome written
    # calls after the loss: only those granted before it
    assert len(delivered) <= ended[1] + concurrency + INTENTS_AHEAD, (ended, len(delivered))
    assert len(delivered) < n
    not_sent = {k for k, row in ledger(pg_dsn, "smtp").items() if row[0] == "pending"}
    assert not_sent == set(state) - confirmed
    assert all("lost its lock" in ledger(pg_dsn, "smtp")[k][4] for k in not_sent)
    second = send(pg_dsn, smtp, emails(n), batch_size=500)
    assert second.ok and second.sent == n - len(confirmed)
    assert smtp.deliveries_by_key() == {f"{KEYS}{i}": 1 for i in range(n)}


def test_resolutions_are_audited_and_only_for_unknown_effects(
    pg_dsn: str, smtp: SmtpServer
) -> None:
    """Mark sent and resend record who, when and why; resolving an effect that is not unknown, or without a reason, is refused and writes nothing."""
    smtp.kill()
    smtp.start(die_after=2)
    send(pg_dsn, smtp, emails(2), concurrency=1, max_attempts=1)
    smtp.wait_dead(30)
    assert statuses(pg_dsn, "smtp") == {f"{KEYS}0": "succeeded", f"{KEYS}1": "unknown"}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(ValueError, match="reason is required"):
            resolve_unknown(conn, "idempotency", remote_system="smtp", idempotency_key=f"{KEYS}1",
                            action="resend", resolved_by="ann", reason=" ")  # fmt: skip
        with pytest.raises(ValueError, match="is succeeded, not unknown"):
            resolve_unknown(conn, "idempotency", remote_system="smtp", idempotency_key=f"{KEYS}0",
                            action="resend", resolved_by="ann", reason="x")  # fmt: skip
        with pytest.raises(ValueError, match="no effect"):
            resolve_unknown(conn, "idempotency", remote_system="smtp", idempotency_key="nope",
                            action="resend", resolved_by="ann", reason="x")  # fmt: skip
        done = resolve_unknown(conn, "idempotency", remote_system="smtp",
                               idempotency_key=f"{KEYS}1", action="mark_sent", resolved_by="ann",
                               reason="in the mailbox")  # fmt: skip
        audit = resolutions(conn, "idempotency", "smtp", f"{KEYS}1")
    assert done.new_status == "succeeded" and done.job_name == "job"
    assert [(a["action"], a["resolved_by"], a["reason"], a["previous_status"]) for a in audit] == [
        ("mark_sent", "ann", "in the mailbox", "unknown")
    ]
    assert audit[0]["resolved_at"] == done.resolved_at
    assert set(statuses(pg_dsn, "smtp").values()) == {"succeeded"}


def test_bad_addresses_are_named_and_the_rest_is_sent(pg_dsn: str, smtp: SmtpServer) -> None:
    """A missing recipient and an invalid address fail the run with an error naming each effect; nothing is written for them and every other message is delivered."""
    items = emails(4)
    items.insert(1, email_effect(f"{KEYS}no_rcpt", to=[], subject="s", text="t"))
    items.insert(3, email_effect(f"{KEYS}bad_addr", to="finance at example", subject="s", text="t"))
    error = send(pg_dsn, smtp, items)
    assert isinstance(error, InvalidEffectError)
    text = str(error)
    assert "2 effect(s) of 'smtp' refused" in text
    assert f"{KEYS}no_rcpt" in text and "no recipient" in text
    assert f"{KEYS}bad_addr" in text and "'finance at example' is not an email address" in text
    assert set(statuses(pg_dsn, "smtp")) == {f"{KEYS}{i}" for i in range(4)}
    assert smtp.deliveries_by_key() == {f"{KEYS}{i}": 1 for i in range(4)}


def test_a_refused_recipient_fails_that_message_only(pg_dsn: str, tmp_path: Path) -> None:
    """The server's 550 for one recipient fails that effect (nothing delivered for it) and the others are delivered."""
    server = SmtpServer(tmp_path / "refusing")
    server.start(refuse=("user2@example.com",))
    try:
        error = send(pg_dsn, server, emails(4))
        assert isinstance(error, RemoteCallError) and "1 effect(s) failed" in str(error)
        assert statuses(pg_dsn, "smtp")[f"{KEYS}2"] == "failed"
        assert "550" in ledger(pg_dsn, "smtp")[f"{KEYS}2"][4]
        assert server.deliveries_by_key() == {f"{KEYS}{i}": 1 for i in (0, 1, 3)}
    finally:
        server.kill()


def test_sender_from_an_airflow_smtp_connection(
    pg_dsn: str, smtp: SmtpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmtpSender.from_connection reads the smtp provider's connection (host, port, from_email, TLS switches) and sends through it."""
    for name, value in smtp_connection_env(
        smtp, "finance_smtp", "finance-jobs@example.org"
    ).items():
        monkeypatch.setenv(name, value)
    sender = SmtpSender.from_connection("finance_smtp")
    assert (sender.host, sender.port, sender.from_email) == (
        "127.0.0.1", smtp.port, "finance-jobs@example.org",
    )  # fmt: skip
    assert sender.security == SmtpSecurity(tls=None, verify=True, login=None, password=None)

    def work(run: RunContext) -> None:
        OutboundLedger(run, "finance").send_all(emails(2), sender)

    run_once(pg_dsn, work)
    assert [d["from"] for d in smtp.deliveries()] == ["finance-jobs@example.org"] * 2
    assert {d["message_id"] for d in smtp.deliveries()} == {
        message_id(f"{KEYS}{i}", "example.org") for i in range(2)
    }


def test_recipients_build_the_request_a_plain_to_builds() -> None:
    """Recipients(to, cc, bcc) and a plain to= make the same request shape (so an existing key keeps its fingerprint); SmtpSecurity keeps the password out of its repr and refuses an unknown tls."""
    plain = email_effect("k", to="a@example.com, b@example.com", subject="s", text="t")
    grouped = email_effect(
        "k", to=Recipients(["a@example.com", "b@example.com"]), subject="s", text="t"
    )
    assert grouped == plain
    assert plain.request == {
        "to": ["a@example.com", "b@example.com"], "cc": [], "bcc": [], "subject": "s", "text": "t",
    }  # fmt: skip
    full = email_effect(
        "k", to=Recipients("a@example.com", cc="c@example.com; d@example.com", bcc=["e@x.org"]),
        subject="s", text="t",
    )  # fmt: skip
    assert (full.request["cc"], full.request["bcc"]) == (
        ["c@example.com", "d@example.com"], ["e@x.org"],
    )  # fmt: skip
    security = SmtpSecurity(tls="starttls", login="jobs", password="s3cret")
    assert "s3cret" not in repr(security) and "jobs" in repr(security)
    with pytest.raises(ValueError, match="tls must be 'ssl', 'starttls' or None"):
        SmtpSecurity(tls="tls")  # type: ignore[arg-type]
    sender = SmtpSender(host="mail.example.com", port=465, security=SmtpSecurity(tls="ssl"))
    assert sender.target == "smtps://mail.example.com:465"
