"""What the calls of an export came to: each effect's outcome, and the export's counts.

Each effect's :class:`Outcome` is written to the ledger by one statement per group; the counts
of the whole export are a :class:`LedgerSummary`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg

from airflow_idempotency._sql import query
from airflow_idempotency.ledger.scope import LedgerScope
from airflow_idempotency.records import storable_text

NOT_SENT = "not sent: this run lost its lock (another attempt may own the key now)"
UNREACHABLE = "not sent: the remote stopped answering; a rerun sends it with the same key"


@dataclass
class LedgerSummary:
    """Counts of one :meth:`OutboundLedger.send_all` call."""

    total: int = 0
    sent: int = 0
    skipped_existing: int = 0
    failed: int = 0
    pending: int = 0
    conflicts: int = 0
    calls: int = 0
    replayed: int = 0  # of ``sent``: the remote replayed its answer (it had the key)
    unknown: int = 0  # not deduplicating: may have happened, not sent again (an operator decides)
    invalid: int = 0  # refused by the sender's check: neither recorded nor sent
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every effect is confirmed (sent now or before)."""
        return not (self.failed or self.pending or self.conflicts or self.unknown or self.invalid)

    def as_counts(self, prefix: str) -> dict[str, int]:
        """Counts for job_runs.details, e.g. ``exports_sent``."""
        return {
            f"{prefix}_sent": self.sent,
            f"{prefix}_skipped_existing": self.skipped_existing,
            f"{prefix}_failed": self.failed,
            f"{prefix}_pending": self.pending,
            f"{prefix}_conflicts": self.conflicts,
            f"{prefix}_unknown": self.unknown,
            f"{prefix}_invalid": self.invalid,
        }


@dataclass(frozen=True)
class Outcome:
    """How the call of one effect ended, as the ledger records it."""

    key: str
    status: str  # succeeded | failed | pending | unknown
    reference: str | None
    error: str | None
    calls: int
    replayed: bool = False


def pending(key: str, reason: str, calls: int = 0) -> Outcome:
    """An effect not called (any more): it stays pending, saying why."""
    return Outcome(key, "pending", None, reason, calls)


def tally(outcomes: list[Outcome], summary: LedgerSummary) -> None:
    """Count ``outcomes`` in ``summary``."""
    for outcome in outcomes:
        summary.calls += outcome.calls
        if outcome.status == "succeeded":
            summary.sent += 1
            summary.replayed += outcome.replayed
        elif outcome.status == "failed":
            summary.failed += 1
            summary.errors.append(f"{outcome.key}: {outcome.error}")
        elif outcome.status == "unknown":
            summary.unknown += 1
            summary.errors.append(f"{outcome.key}: unknown: {outcome.error}")
        else:
            summary.pending += 1
            summary.errors.append(f"{outcome.key}: {outcome.error}")


def write_outcomes(
    conn: psycopg.Connection, run: LedgerScope, remote_system: str, outcomes: list[Outcome]
) -> None:
    """Write ``outcomes`` in one statement (in the transaction ``conn`` is in, if any)."""
    params: dict[str, Any] = {
        "keys": [o.key for o in outcomes],
        "statuses": [o.status for o in outcomes],
        "references": [storable_text(o.reference) for o in outcomes],
        "errors": [storable_text(o.error) for o in outcomes],
        "calls": [o.calls for o in outcomes],
        "remote_system": remote_system,
        "attempt_id": run.attempt_id,
    }
    conn.execute(query("ledger_record_outcomes", run.schema), params)
