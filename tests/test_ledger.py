"""The outbound ledger against the real accounting service process and real Postgres."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from airflow_idempotency import (
    Effect,
    IdempotencyKeyConflictError,
    OutboundLedger,
    RemoteCallError,
    RunContext,
    post_json,
    run_idempotently,
)
from airflow_idempotency.runner import RunOptions


def effects(n: int, prefix: str = "job:2026-10-01:order_", amount: int = 100) -> list[Effect]:
    return [Effect(f"{prefix}{i}", {"order_id": i, "amount_cents": amount}) for i in range(n)]


def send(
    dsn: str, url: str, items: Any, path: str = "/api/invoices", job: str = "job", **options: Any
) -> Any:
    """Run one idempotent execution that sends ``items`` through the ledger; return its summary."""
    out: dict[str, Any] = {}

    def work(run: RunContext) -> dict[str, int]:
        ledger = OutboundLedger(
            run, "accounting", backoff_initial=0.01, backoff_max=0.05, **options
        )
        out["summary"] = ledger.send_all(items, post_json(path), base_url=url)
        return out["summary"].as_counts("exports")

    run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=job,
        run_key="2026-10-01",
        work=work,
        options=RunOptions(force=True),
    )
    return out["summary"]


def ledger_rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT idempotency_key, status, remote_reference IS NOT NULL, call_count, last_error"
            " FROM idempotency.outbound_ledger ORDER BY ledger_id"
        ).fetchall()


def test_send_then_skip_confirmed(pg_dsn: str, accounting) -> None:  # type: ignore[no-untyped-def]
    """Confirmed effects are skipped on the next call without any request to the remote."""
    first = send(pg_dsn, accounting.url, effects(30), batch_size=7)
    assert (first.sent, first.skipped_existing, first.total) == (30, 0, 30)
    requests = accounting.stats()["requests"]
    second = send(pg_dsn, accounting.url, effects(30), batch_size=7)
    assert (second.sent, second.skipped_existing) == (0, 30)
    assert accounting.stats()["requests"] == requests
    assert {status for _, status, _, _, _ in ledger_rows(pg_dsn)} == {"succeeded"}


def test_key_reused_for_another_request_is_refused(pg_dsn: str, accounting) -> None:  # type: ignore[no-untyped-def]
    """A key already used with a different request is refused locally and nothing is sent for it."""
    send(pg_dsn, accounting.url, effects(3))
    requests = accounting.stats()["requests"]
    changed = effects(3, amount=999)
    with pytest.raises(IdempotencyKeyConflictError, match="different request"):
        send(pg_dsn, accounting.url, changed)
    assert accounting.stats()["requests"] == requests
    assert accounting.stats()["invoices"] == 3


def test_permanent_errors_fail_after_the_batch(pg_dsn: str, accounting) -> None:  # type: ignore[no-untyped-def]
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


def test_transient_errors_exhausted_stay_pending(pg_dsn: str, accounting) -> None:  # type: ignore[no-untyped-def]
    """When every try fails with 503 the row stays pending (not confirmed), and a later run confirms it."""
    accounting.set_faults(fail_rate=1.0)
    with pytest.raises(RemoteCallError, match="pending"):
        send(pg_dsn, accounting.url, effects(4), max_attempts=3)
    assert [(s, c) for _, s, _, c, _ in ledger_rows(pg_dsn)] == [("pending", 3)] * 4
    accounting.set_faults(fail_rate=0.0)
    send(pg_dsn, accounting.url, effects(4))
    assert accounting.stats()["invoices"] == 4


def test_dry_run_sends_nothing_and_writes_nothing(pg_dsn: str, accounting) -> None:  # type: ignore[no-untyped-def]
    """A dry run counts what it would send and neither calls out nor writes the ledger."""
    out: dict[str, Any] = {}

    def work(run: RunContext) -> None:
        out["s"] = OutboundLedger(run, "accounting").send_all(
            effects(6), post_json("/api/invoices"), base_url=accounting.url
        )

    run_idempotently(
        connect=lambda: psycopg.connect(pg_dsn),
        job_name="job",
        run_key="2026-10-01",
        work=work,
        options=RunOptions(dry_run=True),
    )
    assert out["s"].sent == 6
    assert accounting.stats()["requests"] == 0
    assert ledger_rows(pg_dsn) == []


def test_streams_without_materialising(pg_dsn: str, accounting) -> None:  # type: ignore[no-untyped-def]
    """The effects iterable is consumed lazily, one batch at a time."""
    pulled: list[int] = []

    def generate():  # type: ignore[no-untyped-def]
        for e in effects(25):
            pulled.append(1)
            yield e

    summary = send(pg_dsn, accounting.url, generate(), batch_size=10)
    assert summary.sent == 25 and len(pulled) == 25


@pytest.mark.parametrize("bad_key", ["", " padded", "new\nline"])
def test_bad_idempotency_keys_are_refused(pg_dsn: str, accounting, bad_key: str) -> None:  # type: ignore[no-untyped-def]
    """A malformed idempotency key is refused before the batch is written or sent."""
    from airflow_idempotency import InvalidInputError

    with pytest.raises(InvalidInputError, match="idempotency key"):
        send(pg_dsn, accounting.url, [Effect(bad_key, {"x": 1})])
    assert ledger_rows(pg_dsn) == []
    assert accounting.stats()["requests"] == 0
