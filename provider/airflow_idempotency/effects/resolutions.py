"""An operator's explicit choice for an effect left ``unknown``: mark it sent, or resend it.

An effect of a remote that does not deduplicate is ``unknown`` when its call began and no
outcome was recorded (a crash, a lost answer): it may have happened, and the ledger never
sends it again on its own. Someone who can look at the remote (the mailbox, the channel)
decides:

- **mark sent** (``mark_sent``): it did happen; the row becomes ``succeeded`` and is never
  sent again;
- **resend** (``resend``): it did not happen (or a second one is acceptable); the row becomes
  ``pending`` and the next run of its key sends it.

Each choice is one statement that also appends who, when, why and the previous status to
``outbound_ledger_resolutions`` (the audit), and it is taken while holding the run lock of the
effect's (job, run key), so that no attempt of that key is sending at the same moment. Only an
``unknown`` effect can be resolved: anything else is refused and nothing is written.

The run lock says no attempt holds the key; it does not say that no call is under way: a
worker that lost its lock (its session terminated, the worker paused) may still be in the
middle of the effect's call. So a resolution is also refused while the effect's intent is
younger than :data:`IN_FLIGHT_BOUND` (10 minutes: far beyond any
sender's timeouts and retries) and the attempt that recorded it has not ended; once that
attempt has ended (its outcome recorded: its calls are over), or the bound has passed, it
can be resolved.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import psycopg

from airflow_idempotency._sql import query_row, query_rows
from airflow_idempotency.exceptions import InvalidInputError, RunLockedError
from airflow_idempotency.leases import lease_is_live
from airflow_idempotency.locks import hold_run_lock, run_lock_key
from airflow_idempotency.run_key import check_text

IN_FLIGHT_BOUND = 600.0
"""Seconds after its intent during which an unknown effect's call may still be in flight
(from an attempt that has not ended): a resolution waits that long."""

Action = Literal["mark_sent", "resend"]
ACTIONS: tuple[Action, ...] = ("mark_sent", "resend")


@dataclass(frozen=True)
class Resolution:
    """One recorded resolution."""

    resolution_id: int
    remote_system: str
    idempotency_key: str
    job_name: str
    run_key: str
    action: Action
    resolved_by: str
    reason: str
    resolved_at: dt.datetime

    @property
    def new_status(self) -> str:
        return "succeeded" if self.action == "mark_sent" else "pending"


def resolve_unknown(
    conn: psycopg.Connection,
    schema: str,
    *,
    remote_system: str,
    idempotency_key: str,
    action: Action,
    resolved_by: str,
    reason: str,
) -> Resolution:
    """Resolve one unknown effect (see the module doc); ``conn``: autocommit and idle.

    Raises :class:`InvalidInputError` (nothing written) for an unknown action, an empty
    reason or name, a key the ledger does not have, or an effect that is not ``unknown``;
    :class:`RunLockedError` while an attempt of the effect's key runs, or while the effect's
    call may still be in flight (see the module doc: :data:`IN_FLIGHT_BOUND`).
    """
    resolved_by, reason = _checked(action, remote_system, idempotency_key, resolved_by, reason)
    effect = _effect(conn, schema, remote_system, idempotency_key)
    with _run_lock_of(conn, schema, effect):
        ledger_id = _unknown_effect_id(conn, schema, remote_system, idempotency_key)
        _refuse_while_in_flight(conn, schema, ledger_id, effect, IN_FLIGHT_BOUND)
        params = {
            "ledger_id": ledger_id,
            "action": action,
            "resolved_by": resolved_by,
            "reason": reason,
        }
        done = query_row(conn, "ledger_resolve_unknown", schema, params)
    assert done is not None  # the row was locked FOR UPDATE and unknown
    return Resolution(
        resolution_id=done["resolution_id"],
        remote_system=remote_system,
        idempotency_key=idempotency_key,
        job_name=effect["job_name"],
        run_key=effect["run_key"],
        action=action,
        resolved_by=resolved_by,
        reason=reason,
        resolved_at=done["resolved_at"],
    )


def _checked(
    action: str, remote_system: str, idempotency_key: str, resolved_by: str, reason: str
) -> tuple[str, str]:
    """Refuse a resolution's bad input before anything is read; (resolved_by, reason)."""
    if action not in ACTIONS:
        raise InvalidInputError(f"action must be one of {ACTIONS}, not {action!r}")
    check_text(remote_system, "remote system name")
    check_text(idempotency_key, "idempotency key")
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInputError("a reason is required: say what you checked at the remote")
    if not isinstance(resolved_by, str) or not resolved_by.strip():
        raise InvalidInputError("who resolves it is required (--by, or $USER)")
    return resolved_by.strip(), reason.strip()


def _effect(conn: psycopg.Connection, schema: str, remote_system: str, key: str) -> dict[str, Any]:
    """The effect's row, read before the lock is taken (its job and run key name the lock)."""
    row = query_row(conn, "ledger_effect", schema, {"remote_system": remote_system, "key": key})
    if row is None:
        raise InvalidInputError(
            f"no effect {key!r} of remote system {remote_system!r} in the ledger "
            "(`airflow-idempotency ledger` lists them)"
        )
    return row


@contextlib.contextmanager
def _run_lock_of(conn: psycopg.Connection, schema: str, effect: dict[str, Any]) -> Iterator[None]:
    """Hold the run lock of the effect's (job, run key) for the block (its transaction is the
    block's); :class:`RunLockedError` while an attempt of that key holds it."""
    lock_key = run_lock_key(effect["job_name"], effect["run_key"])
    with hold_run_lock(
        conn, lock_key, schema=schema, application_name="airflow-idempotency ledger"
    ) as lock:
        if lock is None or lease_is_live(
            conn, effect["job_name"], effect["run_key"], schema=schema
        ):
            raise RunLockedError(
                f"run key {effect['run_key']!r} of {effect['job_name']!r} is locked: an attempt "
                "is running it now (see `airflow-idempotency locks`). Resolve when it has ended."
            )
        yield


def _unknown_effect_id(conn: psycopg.Connection, schema: str, remote_system: str, key: str) -> int:
    """The ledger id of the effect, locked FOR UPDATE; refused unless it is ``unknown``."""
    params = {"remote_system": remote_system, "key": key}
    row = query_row(conn, "ledger_effect_for_update", schema, params)
    if row is None or row["status"] != "unknown":
        status = row["status"] if row else "gone"
        raise InvalidInputError(
            f"effect {key!r} of {remote_system!r} is {status}, not unknown: "
            "nothing to resolve (only an effect whose outcome was lost can be)"
        )
    return int(row["ledger_id"])


def _refuse_while_in_flight(
    conn: psycopg.Connection, schema: str, ledger_id: int, effect: dict[str, Any], bound: float
) -> None:
    """:class:`RunLockedError` while the effect's call may still be under way."""
    row = query_row(conn, "ledger_call_in_flight", schema, {"ledger_id": ledger_id, "bound": bound})
    if row is None:
        return
    by = (
        f"attempt {row['last_attempt_id']} (worker {row['hostname']} pid {row['pid']}), which "
        "has not ended"
        if row["last_attempt_id"] is not None
        else "a task callback"
    )
    wait = max(0.0, bound - float(row["age_seconds"]))
    raise RunLockedError(
        f"effect {effect['idempotency_key']!r} of {effect['remote_system']!r}: its call began "
        f"{float(row['age_seconds']):.0f} s ago, from {by}: it may still be in flight (a worker "
        "that lost its lock ends the calls it had begun). Resolve it once that attempt has "
        f"ended (`airflow-idempotency runs`), or in {wait:.0f} s at the latest."
    )


def resolutions(
    conn: psycopg.Connection, schema: str, remote_system: str, idempotency_key: str
) -> list[dict[str, Any]]:
    """The audit of one effect: every resolution, oldest first."""
    params = {"remote_system": remote_system, "key": idempotency_key}
    return query_rows(conn, "ledger_resolutions", schema, params)
