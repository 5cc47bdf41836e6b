"""The CLI's ledger against a real job database: every kind of effect, the unknown ones first,
and the operator's two actions (mark-sent, resend), audited, refused when they do not apply."""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg
import pytest

from airflow_idempotency.cli import main
from airflow_idempotency.exceptions import OutcomeUnknownError
from airflow_idempotency.ledger.senders import BlockingEffectSender, Confirmation, Effect
from devtools.postgres import PostgresServer, temporary_database
from support.effects import seed_ledger, statuses
from support.locks import run_lock_taken

pytestmark = pytest.mark.both_airflow_lines


def seed(dsn: str) -> None:
    """One effect of each state and three kinds, as the ledger writes them."""
    unknown = "the call began (attempt 7) and no outcome was recorded: it may have happened"
    seed_ledger(
        dsn,
        "job",
        [
            ("accounting", "inv:1", "pending", "http", True, "timeout"),
            ("finance_mail", "mail:1", "unknown", "email", False, unknown),
            ("files:/out", "a.csv", "succeeded", "file", True, None),
            ("notify:chat", "job:2026-10-01:failure", "failed", "notification", False, "HTTP 400"),
        ],
    )


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    capsys.readouterr()
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out.strip() else None, captured.err


def test_ledger_lists_every_kind_unknown_first(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ledger` shows the effects not confirmed of every kind, the unknown one first, and exits 1 while one is unknown."""
    seed(pg_dsn)
    code, out, _ = run(capsys, "ledger", "--dsn", pg_dsn)
    assert code == 1
    first = out["not_confirmed"][0]
    assert (first["idempotency_key"], first["effect_kind"], first["status"]) == (
        "mail:1", "email", "unknown",
    )  # fmt: skip
    assert {r["effect_kind"] for r in out["not_confirmed"]} == {"email", "http", "notification"}
    assert out["summary"][0]["status"] == "unknown"
    code, out, _ = run(capsys, "ledger", "--dsn", pg_dsn, "--all")
    assert {r["effect_kind"] for r in out["summary"]} == {"email", "http", "notification", "file"}
    assert main(["ledger", "--dsn", pg_dsn]) == 1  # the table form too
    assert "mark-sent" in capsys.readouterr().err


def test_mark_sent_and_resend_are_audited(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """mark-sent confirms an unknown effect, recording who, when and why, shown by `ledger --key`; afterwards neither action applies to it and nothing is written."""
    seed(pg_dsn)
    code, done, _ = run(capsys, "ledger", "mark-sent", "finance_mail", "mail:1", "--reason",
                        "Message-ID found in the finance mailbox", "--by", "ann", "--dsn", pg_dsn)  # fmt: skip
    assert code == 0 and (done["action"], done["resolved_by"]) == ("mark_sent", "ann")
    assert statuses(pg_dsn)["mail:1"] == "succeeded"
    code, shown, _ = run(
        capsys, "ledger", "--remote", "finance_mail", "--key", "mail:1", "--dsn", pg_dsn
    )
    assert shown["effect"]["status"] == "succeeded"
    assert [(r["action"], r["resolved_by"], r["reason"]) for r in shown["resolutions"]] == [
        ("mark_sent", "ann", "Message-ID found in the finance mailbox")
    ]
    for action in ("mark-sent", "resend"):
        code, _, err = run(capsys, "ledger", action, "finance_mail", "mail:1", "--reason", "x",
                           "--by", "ann", "--dsn", pg_dsn)  # fmt: skip
        assert code == 2 and "is succeeded, not unknown" in err
    code, _, err = run(
        capsys, "ledger", "resend", "accounting", "inv:1", "--reason", "x", "--by", "a",
        "--dsn", pg_dsn,
    )  # fmt: skip
    assert code == 2 and "is pending, not unknown" in err
    code, _, _ = run(capsys, "ledger", "--dsn", pg_dsn)
    assert code == 0  # nothing unknown any more


def test_resend_makes_it_pending_and_a_running_key_is_refused(
    pg_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """resend makes an unknown effect pending (by $USER when --by is absent); while an attempt of its key holds the run lock, the CLI refuses with exit 75 and writes nothing."""
    seed(pg_dsn)
    monkeypatch.setenv("USER", "oncall-bob")
    with run_lock_taken(pg_dsn, "job", "2026-10-01"):
        code, _, err = run(capsys, "ledger", "resend", "finance_mail", "mail:1", "--reason", "x",
                           "--dsn", pg_dsn)  # fmt: skip
    assert code == 75 and "is locked" in err
    assert statuses(pg_dsn)["mail:1"] == "unknown"
    code, done, _ = run(capsys, "ledger", "resend", "finance_mail", "mail:1", "--reason",
                        "not in the mailbox", "--dsn", pg_dsn)  # fmt: skip
    assert code == 0 and done["resolved_by"] == "oncall-bob"
    assert statuses(pg_dsn)["mail:1"] == "pending"
    # --reason is required (argparse): exit 2
    assert main(["ledger", "resend", "finance_mail", "mail:1", "--dsn", pg_dsn]) == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["ledger", "--dsn", "{B}", "resend", "finance_mail", "mail:1", "--reason", "x"],
        ["--dsn", "{B}", "ledger", "resend", "finance_mail", "mail:1", "--reason", "x"],
        ["ledger", "resend", "--dsn", "{B}", "finance_mail", "mail:1", "--reason", "x"],
        ["ledger", "resend", "finance_mail", "mail:1", "--reason", "x", "--dsn", "{B}"],
    ],
    ids=["before-the-action", "before-the-command", "after-the-action", "at-the-end"],
)
def test_an_option_before_the_action_means_the_same_as_after_it(
    argv: list[str],
    pg_dsn: str,
    pg_server: PostgresServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ledger --dsn B resend ...` resends in database B, wherever --dsn is written, never in
    the database of AIRFLOW_IDEMPOTENCY_DSN (which holds the same unknown effect)."""
    seed(pg_dsn)
    with temporary_database(pg_server, "idem_test_b") as other:
        seed(other)
        monkeypatch.setenv("AIRFLOW_IDEMPOTENCY_DSN", pg_dsn)
        code, done, err = run(capsys, *(other if a == "{B}" else a for a in argv), "--by", "ann")
        assert code == 0, err
        assert (done["action"], statuses(other)["mail:1"]) == ("resend", "pending")
        assert statuses(pg_dsn)["mail:1"] == "unknown"  # the environment's database untouched


class _HeldCall(BlockingEffectSender[None]):
    """A remote that does not deduplicate whose call begins, then waits for ``release``, and
    then loses its answer (the effect stays unknown)."""

    kind = "email"
    deduplicating = False
    concurrency = 1
    target = "smtp://held"

    def __init__(self) -> None:
        self.begun = threading.Event()
        self.release = threading.Event()

    def connect(self) -> None:
        return None

    def send(self, connection: None, effect: Effect) -> Confirmation:
        self.begun.set()
        self.release.wait(60)
        raise OutcomeUnknownError("the answer was lost")


def test_a_resolution_waits_while_a_call_of_a_worker_that_lost_its_lock_is_in_flight(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker whose lock session ended while its call was under way: the run lock is free, yet resend and mark-sent are refused (exit 75, nothing written) until that attempt has ended; then they apply."""
    from airflow_idempotency import OutboundLedger, run_idempotently
    from support.locks import terminate_lock_session

    sender = _HeldCall()
    ended: list[BaseException] = []

    def work(run: Any) -> None:
        OutboundLedger(run, "finance_mail").send_all([Effect("mail:1", {"to": "x"})], sender)

    def worker() -> None:
        try:
            run_idempotently(connect=lambda: psycopg.connect(pg_dsn), job_name="job",
                             run_key="2026-10-01", work=work)  # fmt: skip
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert sender.begun.wait(30)
        terminate_lock_session(pg_dsn, "job", "2026-10-01")
        for action in ("resend", "mark-sent"):
            code, _, err = run(capsys, "ledger", action, "finance_mail", "mail:1", "--reason",
                               "x", "--by", "ann", "--dsn", pg_dsn)  # fmt: skip
            assert code == 75 and "may still be in flight" in err, err
        assert statuses(pg_dsn)["mail:1"] == "unknown"
    finally:
        sender.release.set()
        thread.join(60)
    assert ended, "the worker that lost its lock must fail"
    code, done, _ = run(capsys, "ledger", "resend", "finance_mail", "mail:1", "--reason",
                        "not in the mailbox", "--by", "ann", "--dsn", pg_dsn)  # fmt: skip
    assert code == 0 and done["action"] == "resend"
    assert statuses(pg_dsn)["mail:1"] == "pending"


class _Remote(BlockingEffectSender[None]):
    """A remote of one kind that does not deduplicate: records each delivery; its first
    call of each key loses its answer (so the effect is left unknown)."""

    deduplicating = False
    concurrency = 1
    target = "local"

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.delivered: list[str] = []

    def connect(self) -> None:
        return None

    def send(self, connection: None, effect: Effect) -> Confirmation:
        first = effect.idempotency_key not in self.delivered
        self.delivered.append(effect.idempotency_key)
        if first:
            raise OutcomeUnknownError("the answer was lost")
        return Confirmation("ok")


@pytest.mark.parametrize("kind", ["http", "webhook", "email", "notification", "file"])
def test_both_resolutions_work_for_every_kind(
    pg_dsn: str, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """For an unknown effect of every kind, resend makes the next run of its key deliver it once more and confirm it; mark-sent confirms it and nothing more is sent."""
    from airflow_idempotency import OutboundLedger, run_idempotently
    from airflow_idempotency.exceptions import EffectsUnknownError

    remote = _Remote(kind)
    items = [Effect(f"{kind}:resend", {"n": 1}), Effect(f"{kind}:marked", {"n": 2})]

    def work(run: Any) -> None:
        OutboundLedger(run, "remote").send_all(items, remote)

    def export() -> None:
        run_idempotently(connect=lambda: psycopg.connect(pg_dsn), job_name="job",
                         run_key="2026-10-01", work=work)  # fmt: skip

    with pytest.raises(EffectsUnknownError):
        export()
    assert statuses(pg_dsn) == {f"{kind}:resend": "unknown", f"{kind}:marked": "unknown"}
    for action, key in (("resend", f"{kind}:resend"), ("mark-sent", f"{kind}:marked")):
        code, _, err = run(capsys, "ledger", action, "remote", key, "--reason", "checked",
                           "--by", "ann", "--dsn", pg_dsn)  # fmt: skip
        assert code == 0, err
    export()
    assert statuses(pg_dsn) == {f"{kind}:resend": "succeeded", f"{kind}:marked": "succeeded"}
    assert sorted(remote.delivered) == sorted([f"{kind}:resend"] * 2 + [f"{kind}:marked"])
    export()  # the key completed: a no-op, nothing sent
    assert len(remote.delivered) == 3
