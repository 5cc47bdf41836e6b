"""The sender interface with remotes of both kinds: a local HTTP webhook that does not
deduplicate (and one that does), and a sender of our own (the documented example), against
real Postgres: how each outcome is recorded, and what a rerun sends again."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from email.message import Message
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_idempotency import OutboundLedger, Retries, RunContext
from airflow_idempotency.exceptions import (
    EffectsUnknownError,
    InvalidInputError,
    OutcomeUnknownError,
    PermanentRemoteError,
    RemoteCallError,
    TransientRemoteError,
)
from airflow_idempotency.ledger import (
    BlockingEffectSender,
    Confirmation,
    Effect,
    EffectSender,
    webhook,
)
from airflow_idempotency.records import storable_text
from support.effects import LocalEndpoint, RecordedMetrics, ledger, run_once, statuses


class Hook(LocalEndpoint):
    """A local webhook: answers each POST with the status its test chose for the body's key,
    counting what it acted on (2xx and 500: a 500 here has acted, the answer says otherwise)."""

    def __init__(self) -> None:
        self.acted: Counter[str] = Counter()
        self.answers: dict[int, int] = {}
        super().__init__("/hooks/chat")

    def answer(self, headers: Message, body: bytes) -> int:
        status = self.answers.get(json.loads(body)["n"], 200)
        if status in (200, 500):
            self.acted[headers["Idempotency-Key"]] += 1
        return status


@pytest.fixture
def hook() -> Iterator[Hook]:
    server = Hook()
    yield server
    server.server.shutdown()


def posts(n: int) -> list[Effect]:
    return [Effect(f"chat:2026-10-01:{i}", {"n": i, "text": f"message {i}"}) for i in range(n)]


def deliver(dsn: str, items: list[Effect], sender: Any, metrics: Any = None) -> Any:
    out: dict[str, Any] = {}

    def work(run: RunContext) -> None:
        retries = Retries(max_attempts=2, backoff_initial=0.01, backoff_max=0.02)
        ledger_ = OutboundLedger(run, "chat", retries=retries)
        try:
            out["result"] = ledger_.send_all(items, sender)
        except Exception as exc:
            out["result"] = exc
            raise

    try:
        run_once(dsn, work, force=True, metrics=metrics)
    except Exception:
        assert "result" in out
    return out["result"]


def test_webhook_that_does_not_deduplicate(pg_dsn: str, hook: Hook) -> None:
    """A 2xx is sent, a 503 is retried (it was not processed), a 500 is unknown (counted by the idempotency.ledger.unknown metric) and never sent again, a 400 fails; the rerun sends nothing twice."""
    hook.answers = {1: 500, 2: 400, 3: 503}
    recorded = RecordedMetrics()
    error = deliver(pg_dsn, posts(4), webhook(hook.url), recorded)
    assert isinstance(error, EffectsUnknownError)
    assert statuses(pg_dsn) == {
        "chat:2026-10-01:0": "succeeded",
        "chat:2026-10-01:1": "unknown",
        "chat:2026-10-01:2": "failed",
        "chat:2026-10-01:3": "pending",
    }
    assert {r[1:3] for r in ledger(pg_dsn).values()} == {("webhook", False)}
    tags = {"job": "job", "remote_system": "chat"}
    assert ("idempotency.ledger.unknown", 1, tags) in recorded.counts
    hook.answers = {}
    again_metrics = RecordedMetrics()
    again = deliver(pg_dsn, posts(4), webhook(hook.url), again_metrics)
    assert ("idempotency.ledger.unknown", 1, tags) in again_metrics.counts  # found unknown again
    assert isinstance(again, EffectsUnknownError)  # the 500's effect stays for an operator
    assert hook.acted == Counter({f"chat:2026-10-01:{i}": 1 for i in range(4)})
    assert statuses(pg_dsn)["chat:2026-10-01:1"] == "unknown"


def test_webhook_that_deduplicates_is_sent_again_on_doubt(pg_dsn: str, hook: Hook) -> None:
    """deduplicating=True: a 500 stays pending and the rerun sends it again with the same key."""
    hook.answers = {0: 500}
    error = deliver(pg_dsn, posts(2), webhook(hook.url, deduplicating=True))
    assert isinstance(error, RemoteCallError) and not isinstance(error, EffectsUnknownError)
    assert statuses(pg_dsn)["chat:2026-10-01:0"] == "pending"
    hook.answers = {}
    assert deliver(pg_dsn, posts(2), webhook(hook.url, deduplicating=True)).ok
    assert hook.acted["chat:2026-10-01:0"] == 3  # twice in the first run (a retry), once now


def test_webhook_down_leaves_effects_pending(pg_dsn: str, hook: Hook) -> None:
    """No connection at all proves nothing was delivered: the effects stay pending, not unknown."""
    hook.server.shutdown()
    hook.server.server_close()
    error = deliver(pg_dsn, posts(3), webhook(hook.url))
    assert isinstance(error, RemoteCallError) and not isinstance(error, EffectsUnknownError)
    assert set(statuses(pg_dsn).values()) == {"pending"}


# [START custom_sender]
class AppendToJournal(EffectSender[Path]):
    """Appends each effect's text to a journal file: a remote that cannot tell a resend."""

    kind = "journal"
    deduplicating = False  # at most once: a lost outcome leaves the effect unknown

    def __init__(self, path: Path) -> None:
        self.path = path
        self.target = str(path)

    def check(self, effect: Effect) -> None:
        if not effect.request.get("text"):
            raise InvalidInputError(f"journal effect {effect.idempotency_key!r}: no text")

    async def connect(self) -> Path:
        return self.path

    async def send(self, connection: Path, effect: Effect) -> Confirmation:
        line = f"{effect.idempotency_key} {effect.request['text']}\n"
        if "offline" in effect.request["text"]:
            raise TransientRemoteError("journal offline: nothing written")  # retried
        if "refuse" in effect.request["text"]:
            raise PermanentRemoteError("journal refuses this text")  # failed
        with connection.open("a") as journal:
            journal.write(line)
        if "lost" in effect.request["text"]:
            raise OutcomeUnknownError("written, then the answer was lost")  # unknown
        return Confirmation(reference=f"line {sum(1 for _ in connection.open())}")


# [END custom_sender]


def test_a_sender_of_your_own(pg_dsn: str, tmp_path: Path) -> None:
    """The documented example sender: each outcome it raises lands in its state, a malformed effect is refused by check() and named, and a rerun appends nothing twice."""
    journal = tmp_path / "journal.txt"
    items = [
        Effect(f"j:{i}", {"text": text})
        for i, text in enumerate(["one", "lost", "refuse", "two", "", "offline"])
    ]
    error = deliver(pg_dsn, items, AppendToJournal(journal))
    assert isinstance(error, ValueError) and "journal effect 'j:4': no text" in str(error)
    assert statuses(pg_dsn) == {
        "j:0": "succeeded", "j:1": "unknown", "j:2": "failed", "j:3": "succeeded",
        "j:5": "pending",
    }  # fmt: skip
    deliver(pg_dsn, items, AppendToJournal(journal))
    assert journal.read_text().splitlines() == ["j:0 one", "j:1 lost", "j:3 two"]


class FilePerKey(BlockingEffectSender[Path]):
    """A blocking sender that deduplicates: one file per key, written with an atomic replace
    (a resend replaces it by the same content). Records the threads its calls ran on."""

    kind = "file"
    deduplicating = True
    concurrency = 4

    def __init__(self, folder: Path, busy: set[int]) -> None:
        self.folder = folder
        self.busy = busy  # these effects fail with a transient error
        self.calls: list[str] = []
        self.threads: set[str] = set()
        self.at_once = self.most_at_once = 0
        self.lock = threading.Lock()

    def connect(self) -> Path:
        return self.folder

    def send(self, connection: Path, effect: Effect) -> Confirmation:
        with self.lock:
            self.calls.append(effect.idempotency_key)
            self.threads.add(threading.current_thread().name)
            self.at_once += 1
            self.most_at_once = max(self.most_at_once, self.at_once)
        try:
            time.sleep(0.01)  # a blocking call: the others go on meanwhile
            if effect.request["n"] in self.busy:
                raise TransientRemoteError("busy: nothing written")
            staged = connection / f".{effect.idempotency_key}.partial"
            staged.write_text(str(effect.request["n"]))
            staged.replace(connection / effect.idempotency_key)
        finally:
            with self.lock:
                self.at_once -= 1
        return Confirmation(effect.idempotency_key)


def test_a_blocking_sender_that_deduplicates(pg_dsn: str, tmp_path: Path) -> None:
    """A deduplicating BlockingEffectSender's calls run in threads of their own, concurrency of them at once; a transient error is retried there, then stays pending, and the rerun sends only it."""
    items = [Effect(f"f{i}", {"n": i}) for i in range(20)]
    first = FilePerKey(tmp_path, busy={3})
    error = deliver(pg_dsn, items, first)
    assert isinstance(error, RemoteCallError) and "stayed pending" in str(error)
    assert {k for k, s in statuses(pg_dsn).items() if s != "succeeded"} == {"f3"}
    assert first.calls.count("f3") == 2  # max_attempts=2 in deliver()
    assert 1 < first.most_at_once <= 4
    assert all(name.startswith("ledger-chat") for name in first.threads), first.threads
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"f{i}" for i in range(20) if i != 3
    )
    again = FilePerKey(tmp_path, busy=set())
    assert deliver(pg_dsn, items, again).ok
    assert again.calls == ["f3"] and set(statuses(pg_dsn).values()) == {"succeeded"}


class Unprintable(BlockingEffectSender[None]):
    """A remote whose confirmation and refusal carry what a PostgreSQL text cannot hold: a NUL
    character and half of a surrogate pair (a JSON answer may spell both: "\\u0000", "\\ud800")."""

    kind = "notification"
    deduplicating = True
    target = "unprintable://"

    def connect(self) -> None:
        return None

    def send(self, connection: None, effect: Effect) -> Confirmation:
        if effect.request["n"] == 0:
            return Confirmation("ref\x00\ud800")
        raise PermanentRemoteError("refused: \x00 \ud800")


def test_a_reference_or_error_a_text_column_cannot_hold_is_recorded_escaped(pg_dsn: str) -> None:
    """The remote confirmed the first effect and refused the second, in words a text column
    cannot hold: both outcomes are recorded (NUL and the lone surrogate backslash-escaped), so
    the rerun does not send the confirmed effect again. Before, recording the batch failed
    after the calls (psycopg refuses both), and every confirmation of it was lost."""
    items = [Effect("u0", {"n": 0}), Effect("u1", {"n": 1})]
    error = deliver(pg_dsn, items, Unprintable())
    assert isinstance(error, RemoteCallError), error
    with psycopg.connect(pg_dsn) as conn:
        found = conn.execute(
            "SELECT idempotency_key, status, remote_reference, last_error"
            " FROM idempotency.outbound_ledger WHERE idempotency_key IN ('u0', 'u1')"
            " ORDER BY 1"
        ).fetchall()
    (_, sent, reference, _), (_, refused, _, said) = found
    assert (sent, refused) == ("succeeded", "failed"), found
    assert reference == "ref\\x00\\ud800", found
    assert "refused: \\x00 \\ud800" in said, found


@given(text=st.text())
def test_storable_text_is_unchanged_unless_a_text_column_cannot_hold_it(text: str) -> None:
    kept = storable_text(text)
    assert kept is not None and "\x00" not in kept
    kept.encode("utf-8")  # no half of a surrogate pair left
    clean = "\x00" not in text and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)
    assert (kept == text) == clean
