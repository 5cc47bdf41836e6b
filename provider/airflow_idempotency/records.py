"""The durable run records: ``job_runs``, ``job_run_attempts`` and the values naming a run.

``job_runs`` has one row per job and run key, ``job_run_attempts`` one row per execution,
whatever it did; :class:`RunIdentity` (job, run key, lock key, trigger) and :class:`RunOptions`
name a run.

:class:`RunRecords` writes the records of one run in the bookkeeping ``schema`` (validated by
the caller); every statement names its tables with it, so no connection's search_path matters.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg.types.json import Jsonb

from airflow_idempotency._sql import query, query_row
from airflow_idempotency._transactions import in_one_transaction
from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.locks import (
    RunLock,
    lock_wait_ms,
    run_lock_key,
    server_keepalive_settings,
)
from airflow_idempotency.provenance import Provenance

_HOSTNAME = socket.gethostname()

RunStatus = Literal["started", "completed", "failed"]
AttemptOutcome = Literal[
    "running",
    "completed",
    "failed",
    "noop",
    "lock_held",
    "dry_run",
    "lock_lost",
    "reset",
    "deferred",
]


@dataclass(frozen=True)
class Trigger:
    """Who or what started an execution, and the Airflow ids it ran under."""

    triggered_by: str = "unknown"  # scheduled | manual | backfill | asset-triggered | cli | ...
    triggering_user: str | None = None
    dag_id: str | None = None
    run_id: str | None = None
    task_id: str | None = None
    try_number: int | None = None
    map_index: int | None = None
    partition_key: str | None = None  # the run's Airflow partition key (3.2+): details
    # The timezone the run key's period was read in (a day, week or month key; None for
    # hour keys, which are UTC, and keys of no period): job_runs.key_zone. A job whose
    # earlier keys were made in another zone is refused (the runner's zone check).
    key_zone: str | None = None
    # The task instance id, run type, clear number and DAG version (migration 0011).
    provenance: Provenance = field(default_factory=Provenance)


@dataclass(frozen=True)
class RunOptions:
    """Per-run switches. ``force`` reruns a completed key; ``dry_run`` rolls everything back."""

    force: bool = False
    dry_run: bool = False


@dataclass(frozen=True)
class RunIdentity:
    """Which run this is: the job, the run key (and so its lock key), who triggered it."""

    job_name: str
    run_key: str
    trigger: Trigger = field(default_factory=Trigger)
    lock_key: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lock_key", run_lock_key(self.job_name, self.run_key))

    @property
    def key_params(self) -> dict[str, Any]:
        """Query parameters naming the run: job_name, run_key, lock_key."""
        return {"job_name": self.job_name, "run_key": self.run_key, "lock_key": self.lock_key}


@dataclass(frozen=True)
class RunRecord:
    """A row of ``job_runs``."""

    job_name: str
    run_key: str
    status: RunStatus
    triggered_by: str
    triggering_user: str | None
    dag_id: str | None
    run_id: str | None
    task_id: str | None
    attempt_count: int
    current_attempt_id: int | None
    started_at: dt.datetime
    completed_at: dt.datetime | None
    updated_at: dt.datetime
    details: dict[str, Any] = field(default_factory=dict)
    # What the completing attempt's work returned (None: not completed, or attempt pruned).
    completed_counts: dict[str, Any] | None = None


@dataclass(frozen=True)
class Started:
    """What a start did (:meth:`RunRecords.start_attempt`): its attempt, the key's attempt
    count, the attempts it closed as abandoned; ``completed``: the run it found completed
    (not forced), which it did not take over: its attempt is recorded as a ``noop``."""

    attempt_id: int
    attempt_count: int
    abandoned: int
    completed: RunRecord | None = None


def get_run(conn: psycopg.Connection, schema: str, job_name: str, run_key: str) -> RunRecord | None:
    """The ``job_runs`` row of (job_name, run_key), if any."""
    params = {"job_name": job_name, "run_key": run_key}
    return run_record(query_row(conn, "get_run", schema, params))


_DECIDED_COLUMNS = (
    "status",
    "triggered_by",
    "triggering_user",
    "dag_id",
    "run_id",
    "task_id",
    "attempt_count",
    "current_attempt_id",
    "details",
    "completed_counts",
)
_DECIDED_TIMES = ("started_at", "completed_at", "updated_at")


# A fraction of a second in PostgreSQL's JSON text of a timestamp: trailing zeros trimmed
# (``02:00:01.1+00:00``), which Python 3.10's fromisoformat refuses (it takes 3 or 6 digits).
_FRACTION = re.compile(r"(?<=:\d\d)\.(\d{1,6})")


def _json_timestamp(text: str) -> dt.datetime:
    """A timestamp of PostgreSQL's JSON text (ISO 8601, whatever the DateStyle), on every
    Python the package supports: the fraction padded to microseconds first."""
    return dt.datetime.fromisoformat(
        _FRACTION.sub(lambda m: "." + m.group(1).ljust(6, "0"), text, count=1)
    )


def decided_run(job_name: str, run_key: str, row: dict[str, Any]) -> RunRecord:
    """The ``job_runs`` row that run_decide read, from the ``decide`` query's JSON object
    (its timestamps are ISO 8601 text there)."""
    times: dict[str, Any] = {
        name: None if row[name] is None else _json_timestamp(row[name]) for name in _DECIDED_TIMES
    }
    columns = {name: row[name] for name in _DECIDED_COLUMNS}
    return RunRecord(job_name=job_name, run_key=run_key, **columns, **times)


def storable_text(text: str | None) -> str | None:
    """``text`` as a PostgreSQL text value can hold it: a NUL character and half of a surrogate
    pair (both of which a remote's JSON answer may spell, ``\\u0000``, ``\\ud800``)
    backslash-escaped (``\\x00``, ``\\ud800``), anything else unchanged. For the texts the
    records store that come from elsewhere (an error's message, a remote's reference), which
    are written after work or a call was done: refused there, the record would be lost (a
    failure left ``running``, a confirmation not recorded and its effect sent again)."""
    if text is None:
        return None
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def storable_counts(value: Mapping[str, Any] | None) -> dict[str, Any]:
    """What the work function returned, as the completion stores it in ``job_runs.details``
    (jsonb); refused with an error naming what to return when jsonb could not hold it."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"the work function must return a dict of counts or None, got {type(value).__name__}"
        )
    counts = dict(value)
    # Checked here, before the completion: a value PostgreSQL's jsonb refuses (NaN, an
    # infinity, a NUL character, half of a surrogate pair) would fail the completion's write
    # after the work committed, with the attempt left running.
    try:
        text = json.dumps(counts, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        raise InvalidInputError(
            f"the work function returned counts that the run record cannot hold ({exc}): "
            "return a dict whose values are numbers (not NaN or infinite), strings, booleans, "
            "None, lists or dicts of them"
        ) from None
    if _has_nul(counts):
        raise InvalidInputError(
            "the work function returned counts with a NUL character (\\x00) in a key or a "
            "string, which PostgreSQL's jsonb cannot store: remove it from the counts"
        )
    return counts


def _has_nul(value: Any) -> bool:
    """Whether a NUL character stands in a string or a key anywhere in ``value``."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_nul(v) for v in value)
    return False


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def run_record(row: dict[str, Any] | None) -> RunRecord | None:
    """A row of the ``get_run`` query (a dict row) as a :class:`RunRecord`."""
    return RunRecord(**row) if row else None


def _execute(
    conn: psycopg.Connection, statement: str, params: dict[str, Any], and_commit: bool
) -> psycopg.Cursor[Any]:
    """Run ``statement``, and with ``and_commit`` a COMMIT after it, in one round trip."""
    if not and_commit:
        return conn.execute(statement, params)
    with conn.pipeline():
        cursor = conn.execute(statement, params)
        conn.execute("COMMIT")
    return cursor


class RunRecords:
    """The records of one run (:class:`RunIdentity`) in ``schema``, written through any
    connection the caller gives: the lock transaction's, the work's, a fresh one."""

    def __init__(self, schema: str, run: RunIdentity) -> None:
        self.schema = schema
        self.run = run

    def _attempt_params(self, lock: RunLock | None, options: RunOptions) -> dict[str, Any]:
        """The columns every attempt row gets: who, which key, which worker, which lock session."""
        trigger = self.run.trigger
        return {
            **self.run.key_params,
            **self._trigger_columns(),
            **trigger.provenance.params,
            # Facts of the trigger that have no column: the attempt's details from its start.
            "trigger_details": Jsonb(self._trigger_details(lock)),
            "key_zone": trigger.key_zone,
            "hostname": _HOSTNAME,
            "pid": os.getpid(),
            # a lease has no lock session (the lease mode: its holder is in the details)
            "lock_backend_pid": lock.backend_pid if lock and not lock.is_lease else None,
            "force": options.force,
        }

    def _trigger_columns(self) -> dict[str, Any]:
        """Who triggered the attempt and the Airflow ids it ran under: columns of every
        attempt row, whichever statement writes it."""
        trigger = self.run.trigger
        return {
            "triggered_by": trigger.triggered_by,
            "triggering_user": trigger.triggering_user,
            "dag_id": trigger.dag_id,
            "run_id": trigger.run_id,
            "task_id": trigger.task_id,
            "try_number": trigger.try_number,
            "map_index": trigger.map_index,
        }

    def _trigger_details(self, lock: RunLock | None) -> dict[str, Any]:
        trigger = self.run.trigger
        return ({"partition_key": trigger.partition_key} if trigger.partition_key else {}) | (
            {"lease": lock.holder} if lock and lock.is_lease else {}
        )

    def decision_params(self, options: RunOptions, session: dict[str, str]) -> dict[str, Any]:
        """The parameters of the ``decide`` query (migration 16's run_decide): the key, the
        switches, the lock transaction's ``session`` settings, and the columns of the no-op
        attempt it may record (as one JSON object)."""
        trigger = self.run.trigger
        provenance = trigger.provenance
        attempt = {
            **self._trigger_columns(),
            "hostname": _HOSTNAME,
            "pid": os.getpid(),
            "dry_run": options.dry_run,
            "trigger_details": self._trigger_details(None),
            "ti_id": _text(provenance.ti_id),
            "run_type": provenance.run_type,
            "clear_number": provenance.clear_number,
            "dag_version_id": _text(provenance.dag_version_id),
        }
        return {
            **self.run.key_params,
            "force": options.force,
            "key_zone": trigger.key_zone,
            "session": Jsonb(session),
            "attempt": Jsonb(attempt),
        }

    def insert_attempt(
        self,
        conn: psycopg.Connection,
        outcome: AttemptOutcome,
        *,
        lock: RunLock | None,
        options: RunOptions,
        error: str | None = None,
        details: dict[str, Any] | None = None,
        and_commit: bool = False,
    ) -> int:
        """Record one execution; an outcome other than ``running`` is recorded as finished.

        ``and_commit`` sends ``COMMIT`` in the same round trip (ending the caller's
        transaction: the lock transaction of a no-op or a refused run).
        """
        params = self._attempt_params(lock, options)
        params.update(
            outcome=outcome,
            dry_run=options.dry_run,
            error=storable_text(error),
            details=Jsonb(details or {}),
        )
        row = _execute(conn, query("insert_attempt", self.schema), params, and_commit).fetchone()
        assert row is not None
        return int(row[0])

    def start_attempt(
        self, conn: psycopg.Connection, lock: RunLock, options: RunOptions
    ) -> Started:
        """Record a running attempt and mark the run started by it (a dry run only records
        the attempt), in one READ COMMITTED transaction (two round trips: its BEGIN, then the
        rest with the COMMIT).

        It first takes the key over from the fence (``fence_take_over``, migrations 0006, 0008,
        0012 and 0013), and is refused (SQLSTATE ``IF001``) unless ``lock`` is still held: it
        waits until every fenced transaction of an earlier attempt has ended, so no
        write of a previous attempt can commit after this start; at most
        :func:`~airflow_idempotency.locks.lock_wait_ms` (then SQLSTATE ``IF002``, naming the
        sessions it waited for), the bound of every lock wait of the transaction. Any other
        attempt of the key still marked running is closed as abandoned (the caller holds the
        lock, so its worker died); a dry run's count is 0. A run found completed after that
        wait (a completion whose COMMIT landed after the decision read the run) is not taken
        over unless forced: the attempt is recorded as a ``noop`` and ``completed`` returned.
        """
        params = self._attempt_params(lock, options)
        take_over = (
            query("fence_take_over", self.schema),
            {
                **params,
                **lock.params,
                "lock_wait_ms": lock_wait_ms(),
                **server_keepalive_settings(conn),
            },
        )
        if options.dry_run:
            params.update(outcome="running", dry_run=True, error=None, details=Jsonb({}))
            record = (query("insert_attempt", self.schema), params)
        else:
            record = (query("start_attempt", self.schema), params)
        *_, cursor = in_one_transaction(conn, [take_over, record])
        row = cursor.fetchone()
        assert row is not None
        if options.dry_run:
            return Started(int(row[0]), 0, 0)
        run = self.run
        completed = decided_run(run.job_name, run.run_key, row[3]) if row[3] is not None else None
        return Started(int(row[0]), int(row[1]), int(row[2]), completed)

    def finish_attempt(
        self,
        conn: psycopg.Connection,
        attempt_id: int,
        outcome: AttemptOutcome,
        *,
        error: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        """Record how an execution ended."""
        conn.execute(
            query("finish_attempt", self.schema),
            {
                "attempt_id": attempt_id,
                "outcome": outcome,
                "error": storable_text(error),
                "details": Jsonb(details or {}),
            },
        )

    def complete_attempt(
        self,
        conn: psycopg.Connection,
        attempt_id: int,
        lock: RunLock,
        counts: dict[str, Any],
        *,
        and_commit: bool = False,
    ) -> bool:
        """Mark the run and the attempt completed; ``False`` (nothing written) when this
        attempt no longer owns the run or its lock.

        Must run in the lock transaction, on the lock connection: the statement checks that
        this very session still holds the advisory lock (fencing). Its COMMIT
        (``and_commit``: in the same round trip) records the completion and releases the
        lock at one instant.
        """
        params = {
            **self.run.key_params,
            "attempt_id": attempt_id,
            "details": Jsonb(counts),
            **lock.params,
        }
        cursor = _execute(conn, query("complete_attempt", self.schema), params, and_commit)
        return cursor.fetchone() is not None

    def complete_attempt_lease(
        self, conn: psycopg.Connection, attempt_id: int, counts: dict[str, Any]
    ) -> bool:
        """The lease mode's completion: mark the run and the attempt completed; ``False``
        (nothing written) when this attempt no longer owns the run. Must run in a fenced
        transaction of the attempt (its checks at BEGIN and at COMMIT stand for the lock's)."""
        params = {**self.run.key_params, "attempt_id": attempt_id, "details": Jsonb(counts)}
        row = conn.execute(query("complete_attempt_lease", self.schema), params).fetchone()
        return row is not None

    def mark_failed(self, conn: psycopg.Connection, attempt_id: int, error: str) -> bool:
        """Mark the run failed, if ``attempt_id`` still owns it."""
        params = {**self.run.key_params, "attempt_id": attempt_id, "error": storable_text(error)}
        return conn.execute(query("mark_failed", self.schema), params).fetchone() is not None
