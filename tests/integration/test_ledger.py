"""The outbound ledger against the real accounting service process and real Postgres."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from airflow_idempotency import (
    Effect,
    InvalidInputError,
    LockLostError,
    OutboundLedger,
    RemoteCallError,
    Retries,
    RunContext,
    post_json,
)
from airflow_idempotency.exceptions import IdempotencyKeyConflictError
from airflow_idempotency.ledger import check_idempotency_key
from airflow_idempotency.run_key import MAX_KEY_LENGTH, check_text
from devtools.accounting import AccountingService
from support.db import rows
from support.effects import run_once
from support.locks import terminate_lock_session


def effects(n: int, prefix: str = "job:2026-10-01:order_", amount: int = 100) -> list[Effect]:
    return [Effect(f"{prefix}{i}", {"order_id": i, "amount_cents": amount}) for i in range(n)]


def send(
    dsn: str, url: str, items: Any, path: str = "/api/invoices", job: str = "job", **options: Any
) -> Any:
    """Run one idempotent execution that sends ``items`` through the ledger; return its summary."""
    out: dict[str, Any] = {}

    def work(run: RunContext) -> dict[str, int]:
        retries = Retries(options.pop("max_attempts", 5), backoff_initial=0.01, backoff_max=0.05)
        ledger = OutboundLedger(run, "accounting", retries=retries, **options)
        summary = out["summary"] = ledger.send_all(items, post_json(path), base_url=url)
        return summary.as_counts("exports")

    run_once(dsn, work, job=job, force=True)
    return out["summary"]


def ledger_rows(dsn: str) -> list[tuple[Any, ...]]:
    return rows(
        dsn,
        "SELECT idempotency_key, status, remote_reference IS NOT NULL, call_count, last_error"
        " FROM idempotency.outbound_ledger ORDER BY ledger_id",
    )


def test_send_then_skip_confirmed(pg_dsn: str, accounting: AccountingService) -> None:
    """Confirmed effects are skipped on the next call without any request to the remote."""
    first = send(pg_dsn, accounting.url, effects(30), batch_size=7)
    assert (first.sent, first.skipped_existing, first.total) == (30, 0, 30)
    requests = accounting.stats()["requests"]
    second = send(pg_dsn, accounting.url, effects(30), batch_size=7)
    assert (second.sent, second.skipped_existing) == (0, 30)
    assert accounting.stats()["requests"] == requests
    assert {status for _, status, _, _, _ in ledger_rows(pg_dsn)} == {"succeeded"}


def test_key_reused_for_another_request_is_refused(
    pg_dsn: str, accounting: AccountingService
) -> None:
    """A key already used with a different request is refused locally and nothing is sent for it."""
    send(pg_dsn, accounting.url, effects(3))
    requests = accounting.stats()["requests"]
    changed = effects(3, amount=999)
    with pytest.raises(IdempotencyKeyConflictError, match="different request"):
        send(pg_dsn, accounting.url, changed)
    assert accounting.stats()["requests"] == requests
    assert accounting.stats()["invoices"] == 3


def test_permanent_errors_fail_after_the_batch(pg_dsn: str, accounting: AccountingService) -> None:
    """A 4xx marks every row failed with the reason, the whole stream is processed, then the run fails."""
    with pytest.raises(RemoteCallError, match="failed"):
        send(pg_dsn, accounting.url, effects(5), path="/api/no-such-endpoint")
    rows = ledger_rows(pg_dsn)
    assert len(rows) == 5
    assert all(
        status == "failed" and calls == 1 and "HTTP 404" in err for _, status, _, calls, err in rows
    )
    # A rerun retries the failed rows with the same keys.
    send(pg_dsn, accounting.url, effects(5))
    assert {status for _, status, _, _, _ in ledger_rows(pg_dsn)} == {"succeeded"}
    assert accounting.stats()["invoices"] == 5


def test_transient_errors_exhausted_stay_pending(
    pg_dsn: str, accounting: AccountingService
) -> None:
    """When every try fails with 503 the row stays pending (not confirmed), and a later run confirms it."""
    accounting.set_faults(fail_rate=1.0)
    with pytest.raises(RemoteCallError, match="pending"):
        send(pg_dsn, accounting.url, effects(4), max_attempts=3)
    assert [(s, c) for _, s, _, c, _ in ledger_rows(pg_dsn)] == [("pending", 3)] * 4
    accounting.set_faults(fail_rate=0.0)
    send(pg_dsn, accounting.url, effects(4))
    assert accounting.stats()["invoices"] == 4


def test_dry_run_sends_nothing_and_writes_nothing(
    pg_dsn: str, accounting: AccountingService
) -> None:
    """A dry run counts what it would send and neither calls out nor writes the ledger."""
    out: dict[str, Any] = {}

    def work(run: RunContext) -> None:
        out["s"] = OutboundLedger(run, "accounting").send_all(
            effects(6), post_json("/api/invoices"), base_url=accounting.url
        )

    run_once(pg_dsn, work, dry_run=True)
    assert out["s"].sent == 6
    assert accounting.stats()["requests"] == 0
    assert ledger_rows(pg_dsn) == []


def test_streams_without_materialising(pg_dsn: str, accounting: AccountingService) -> None:
    """The effects iterable is consumed lazily, one batch at a time."""
    pulled: list[int] = []

    def generate() -> Iterator[Effect]:
        for e in effects(25):
            pulled.append(1)
            yield e

    summary = send(pg_dsn, accounting.url, generate(), batch_size=10)
    assert summary.sent == 25 and len(pulled) == 25


@pytest.mark.parametrize("bad_key", ["", " padded", "new\nline"])
def test_bad_idempotency_keys_are_refused(
    pg_dsn: str, accounting: AccountingService, bad_key: str
) -> None:
    """A malformed idempotency key is refused before the batch is written or sent."""
    with pytest.raises(InvalidInputError, match="idempotency key"):
        send(pg_dsn, accounting.url, [Effect(bad_key, {"x": 1})])
    assert ledger_rows(pg_dsn) == []
    assert accounting.stats()["requests"] == 0


def test_rerun_over_confirmed_keys_writes_nothing_and_still_detects_a_changed_request(
    pg_dsn: str, accounting: AccountingService
) -> None:
    """Confirmed keys are skipped without a write (no row touched, no ledger_id drawn); one confirmed key with a changed request in the same batch is refused and not sent, new keys are sent."""
    send(pg_dsn, accounting.url, effects(20), batch_size=8)

    def snapshot() -> tuple[Any, ...]:
        with psycopg.connect(pg_dsn) as conn:
            rows = conn.execute(
                "SELECT idempotency_key, status, updated_at, last_attempt_id, call_count"
                " FROM idempotency.outbound_ledger ORDER BY ledger_id"
            ).fetchall()
            seq = conn.execute(
                "SELECT last_value FROM idempotency.outbound_ledger_ledger_id_seq"
            ).fetchone()
        return rows, seq

    before = snapshot()
    requests = accounting.stats()["requests"]
    again = send(pg_dsn, accounting.url, effects(20), batch_size=8)
    assert (again.sent, again.skipped_existing, again.total) == (0, 20, 20)
    assert snapshot() == before
    assert accounting.stats()["requests"] == requests

    mixed = effects(20) + effects(3, prefix="job:2026-10-01:new_")
    mixed[13] = Effect(mixed[13].idempotency_key, {"order_id": 13, "amount_cents": 101})
    calls: list[str] = []
    post = post_json("/api/invoices")

    async def counting(client: Any, effect: Effect) -> Any:
        calls.append(effect.idempotency_key)
        return await post(client, effect)

    out: dict[str, Any] = {}

    def work(run: RunContext) -> None:
        ledger = OutboundLedger(run, "accounting", batch_size=8)
        try:
            ledger.send_all(mixed, counting, base_url=accounting.url)
        except IdempotencyKeyConflictError as exc:
            out["error"] = str(exc)

    run_once(pg_dsn, work, force=True)
    assert "1 idempotency key(s)" in out["error"] and "order_13" in out["error"]
    assert sorted(calls) == [f"job:2026-10-01:new_{i}" for i in range(3)]
    rows = {key: status for key, status, *_ in ledger_rows(pg_dsn)}
    assert rows["job:2026-10-01:order_13"] == "succeeded"  # the first request's confirmation
    assert len(rows) == 23 and set(rows.values()) == {"succeeded"}


def test_dry_run_classifies_confirmed_changed_and_new_keys_without_writing(
    pg_dsn: str, accounting: AccountingService
) -> None:
    """A dry run skips confirmed keys, counts new ones as would-be-sent, refuses a changed request, and writes nothing."""
    send(pg_dsn, accounting.url, effects(6))
    before = ledger_rows(pg_dsn)
    requests = accounting.stats()["requests"]
    out: dict[str, Any] = {}

    def work(run: RunContext, items: list[Effect]) -> None:
        ledger = OutboundLedger(run, "accounting", batch_size=4)
        try:
            out["summary"] = ledger.send_all(items, post_json("/api/invoices"), base_url="http://x")
        except IdempotencyKeyConflictError as exc:
            out["error"] = str(exc)

    def dry(items: list[Effect]) -> None:
        out.clear()
        # force: the key's run is completed
        run_once(pg_dsn, lambda run: work(run, items), force=True, dry_run=True)

    dry(effects(9))
    summary = out["summary"]
    assert (summary.total, summary.skipped_existing, summary.sent) == (9, 6, 3)
    changed = effects(6)
    changed[2] = Effect(changed[2].idempotency_key, {"order_id": 2, "amount_cents": 5})
    dry(changed)
    assert "1 idempotency key(s)" in out["error"]
    assert ledger_rows(pg_dsn) == before
    assert accounting.stats()["requests"] == requests


def test_a_claim_commits_only_while_the_lock_is_held(
    pg_dsn: str, accounting: AccountingService
) -> None:
    """The fencing check runs after the claim statement, just before its commit: a lock lost while the claim is in flight rolls the claim back, and nothing is sent."""

    def generate() -> Iterator[Effect]:
        yield from effects(5)
        # Pulled for the next batch while the first batch's claim is in flight.
        terminate_lock_session(pg_dsn, "job", "2026-10-01")
        yield from effects(5, prefix="job:2026-10-01:later_")

    with pytest.raises(LockLostError):
        send(pg_dsn, accounting.url, generate(), batch_size=5)
    assert ledger_rows(pg_dsn) == []
    assert accounting.stats()["requests"] == 0


@pytest.mark.parametrize("failure", ["source error", "bad key"])
def test_an_error_in_the_stream_is_raised_after_the_batches_before_it(
    pg_dsn: str, accounting: AccountingService, failure: str
) -> None:
    """The next batch is pulled while the current one is claimed, but an error in pulling or checking it is raised only once the batches before it are sent and recorded."""

    def generate() -> Iterator[Effect]:
        yield from effects(8)
        if failure == "bad key":
            yield Effect("job:2026-10-01:bad\nkey", {"order_id": 8})
        else:
            raise RuntimeError("source error")

    expected = RuntimeError if failure == "source error" else InvalidInputError
    with pytest.raises(expected):
        send(pg_dsn, accounting.url, generate(), batch_size=4)
    rows = ledger_rows(pg_dsn)
    assert [(key, status) for key, status, *_ in rows] == [
        (f"job:2026-10-01:order_{i}", "succeeded") for i in range(8)
    ]
    assert accounting.stats()["invoices"] == 8


# -- the claim's per-key work, without a database -------------------------------------------

KEY_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=12),  # any code point
    st.text(st.characters(max_codepoint=0x7F), max_size=12),  # ASCII, controls included
    st.from_regex(r"[ -~]{0,30}", fullmatch=True),  # printable ASCII, blanks anywhere
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=198, max_size=202),
    st.builds(
        "{}{}{}".format,
        st.sampled_from(["", " ", "\t", "\x1f", "\x7f", "\x85", "\xa0"]),
        st.from_regex(r"[!-~]{1,8}", fullmatch=True),
        st.sampled_from(["", " ", "\n", "\x0b", "\x1c", "\x7f", "\u2028", "\u3000"]),
    ),
)


def _reference_key_check(key: object) -> str:
    """What check_idempotency_key accepted before its ASCII fast path."""
    check_text(key, "idempotency key")
    assert isinstance(key, str)
    if not key.isascii():
        raise InvalidInputError(f"idempotency key {key!r} is not ASCII")
    return key


class _Text(str):
    """A str subclass: the fast path leaves it to the full check."""


@settings(max_examples=2000, deadline=None, database=None)
@given(key=st.one_of(KEY_TEXT, KEY_TEXT.map(_Text), st.integers(), st.none(), st.binary()))
@example(key="")
@example(key=" ")
@example(key="a" * MAX_KEY_LENGTH)
@example(key="a" * (MAX_KEY_LENGTH + 1))
@example(key="order\x7f1")
@example(key="\x1ckey")
def test_the_key_check_accepts_and_refuses_exactly_as_the_full_check(key: object) -> None:
    """check_idempotency_key (with its ASCII fast path) accepts exactly the keys that check_text plus the ASCII rule accept, and returns them unchanged."""
    try:
        expected: object = _reference_key_check(key)
    except InvalidInputError:
        expected = InvalidInputError
    try:
        got: object = check_idempotency_key(key)
    except InvalidInputError:
        got = InvalidInputError
    assert got == expected
    if expected is not InvalidInputError:
        assert got is key


REQUEST = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinities included: json.dumps writes them
    | st.text(max_size=10)
    | st.dates(),  # through default=str
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=10,
)


@settings(max_examples=500, deadline=None, database=None)
@given(request=st.dictionaries(st.text(max_size=8), REQUEST, max_size=6))
def test_the_fingerprint_is_the_sha256_of_the_canonical_json(request: dict[str, Any]) -> None:
    """Effect.fingerprint stays byte-for-byte what is stored in existing ledgers: sha256 of json.dumps(sort_keys, compact separators, default=str)."""
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), default=str)
    expected = hashlib.sha256(canonical.encode()).hexdigest()
    assert Effect("k", request).fingerprint == expected


def test_retries_refuse_what_cannot_be_a_retry_policy() -> None:
    """Retries(...) says what is wrong with it at once: no try at all, negative waits, and a ledger given something else."""
    with pytest.raises(InvalidInputError, match="max_attempts must be an integer >= 1"):
        Retries(max_attempts=0)
    with pytest.raises(InvalidInputError, match="are seconds, >= 0"):
        Retries(backoff_initial=-1)
    with pytest.raises(InvalidInputError, match=r"retries must be a Retries\(...\)"):
        OutboundLedger(None, "accounting", retries=3)  # type: ignore[arg-type]
    assert Retries() == Retries(max_attempts=5, backoff_initial=0.2, backoff_max=5.0)
