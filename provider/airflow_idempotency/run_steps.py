"""The steps of one run in the advisory lock mode, and what a run returns.

The module doc of :mod:`~airflow_idempotency.runner` says what each step does.
:class:`Run` holds the key with an advisory lock in a transaction kept open on a connection
of its own; :class:`~airflow_idempotency.lease_run.LeaseRun` builds on it for the lease mode.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg

from airflow_idempotency import metrics
from airflow_idempotency._sql import query, query_row
from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import (
    IdempotencyError,
    LockLostError,
    LockWaitError,
    MissingPrivilegeError,
    RunLockedError,
)
from airflow_idempotency.fence import (
    bookkeeping_lock_holders,
    fence_refused,
    fence_sqlstate,
    lock_wait_refusal,
)
from airflow_idempotency.key_zone import refuse_zone_change
from airflow_idempotency.leases import describe_lease
from airflow_idempotency.locks import (
    RunLock,
    lock_transaction,
    lock_wait_ms,
    pooler_refusal,
    server_keepalive_settings,
    shared_session_error,
)
from airflow_idempotency.records import (
    RunOptions,
    RunRecord,
    RunRecords,
    decided_run,
    storable_counts,
)
from airflow_idempotency.run_context import (
    ConnectionFactory,
    RunContext,
    RunLogger,
    RunSpec,
    autocommit_connection,
)
from airflow_idempotency.run_failures import named_failure, record_deferral, record_failure
from airflow_idempotency.schema import (
    ensure_schema,
    missing_privileges,
    privilege_refusal,
)
from airflow_idempotency.step_watch import SlowStepWatch

log = logging.getLogger("airflow_idempotency")

START_WAIT_WARNING = 10
"""Seconds after which a start that is still waiting says why it may be waiting."""

Work = Callable[[RunContext], Mapping[str, Any] | None]
_T = TypeVar("_T")


class WorkDeferred(Exception):
    """Raised by a work to end its attempt as ``deferred`` instead of failed: the attempt is
    recorded ``deferred``, the run stays ``started``, the lock is released, and this
    exception propagates out of :func:`~airflow_idempotency.runner.run_idempotently` with
    the caller's own exception in :attr:`deferral` (the cluster policy's: Airflow's
    ``TaskDeferred``, docs/policy.md). The work resumes later as a new attempt of the key."""

    def __init__(self, deferral: BaseException) -> None:
        super().__init__(f"the work deferred ({type(deferral).__name__})")
        self.deferral = deferral


class CompletedBeforeStart(Exception):
    """The start found the run completed (a completion that landed after the decision read
    the run): its attempt is recorded as a no-op, and the work does not run."""

    def __init__(self, run: RunRecord) -> None:
        super().__init__("the run was completed before this attempt's start")
        self.run = run


class RunOutcome(str, enum.Enum):
    """How a call of :func:`~airflow_idempotency.runner.run_idempotently` ended (failures
    raise instead)."""

    COMPLETED = "completed"
    NOOP = "noop"
    DRY_RUN = "dry_run"


@dataclass(frozen=True)
class RunResult:
    """What :func:`~airflow_idempotency.runner.run_idempotently` did."""

    outcome: RunOutcome
    job_name: str
    run_key: str
    attempt_id: int
    counts: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly form. (The operator returns only ``counts``: its docstring says why.)"""
        return {
            "outcome": self.outcome.value,
            "job_name": self.job_name,
            "run_key": self.run_key,
            "attempt_id": self.attempt_id,
            "counts": self.counts,
        }


@dataclass(frozen=True)
class Decision:
    """What the decision found: the run lock (``None``: another session holds it), the key's
    run record, and the no-op attempt it recorded (a completed key, not forced)."""

    lock: RunLock | None
    existing: RunRecord | None
    noop_attempt_id: int | None
    leased: bool = False  # refused: a completed key under another worker's live lease


def replayed(existing: RunRecord) -> dict[str, Any]:
    """The counts a no-op passes on: those the completing attempt's work returned (details
    also keeps what failed attempts and resets added); details if that attempt was pruned."""
    counts = existing.completed_counts
    return dict(counts if counts is not None else existing.details)


def describe_holder(conn: psycopg.Connection, schema: str, lock_key: int) -> dict[str, Any]:
    row = query_row(conn, "run_lock_holder", schema, {"lock_key": lock_key})
    if not row:
        return {}
    holder = {k: v for k, v in row.items() if not k.startswith("attempt_")}
    if row["attempt_attempt_id"] is not None:
        holder["attempt"] = {
            k.removeprefix("attempt_"): v for k, v in row.items() if k.startswith("attempt_")
        }
    return holder


@functools.cache
def _application_name_of(pid: int) -> str:
    return f"airflow-idempotency {socket.gethostname()} pid {pid}"


def _application_name() -> str:
    """What pg_stat_activity shows for a run's lock session (Postgres keeps 63 bytes)."""
    return _application_name_of(os.getpid())


def format_holder(holder: Mapping[str, Any]) -> str:
    if not holder:
        return "a session that released it a moment ago"
    parts = [f"backend pid {holder.get('pid')}"]
    if holder.get("application_name"):
        parts.append(f"application {holder['application_name']!r}")
    parts.append(f"client {holder.get('client')}")
    if holder.get("backend_start"):
        parts.append(f"connected since {holder['backend_start'].isoformat()}")
    attempt = holder.get("attempt")
    if attempt:
        parts.append(
            f"worker {attempt['hostname']} pid {attempt['pid']} (attempt {attempt['attempt_id']}, "
            f"dag {attempt['dag_id']} run {attempt['run_id']}, "
            f"started {attempt['started_at'].isoformat()})"
        )
    return ", ".join(parts)


def _privilege_refusal(
    connect: ConnectionFactory, schema: str, exc: psycopg.Error
) -> MissingPrivilegeError | None:
    """What the role lacks on the bookkeeping tables, if that is why ``exc`` was raised
    (asked on a new connection: the refused one may be in an aborted transaction)."""
    try:
        with autocommit_connection(connect) as conn:
            missing = missing_privileges(conn, schema)
            if not missing:
                return None
            return privilege_refusal(exc, conn, schema, migrating=False, missing=missing)
    except psycopg.Error:
        return None


def decide(
    conn: psycopg.Connection, spec: RunSpec, records: RunRecords, zone_checked: bool = False
) -> Decision:
    """Begin the lock transaction on ``conn`` and decide, in one round trip: the zone rule, the
    run lock, the key's run record, and a completed key's no-op recorded (migration 16's
    run_decide; the ``decide`` query says why one simple-protocol message). The lock
    transaction stays open; its COMMIT records a no-op."""
    run = spec.run
    session = {
        "lock_wait_ms": lock_wait_ms(),
        "application_name": _application_name(),
        **server_keepalive_settings(conn),
    }
    params = records.decision_params(spec.options, session)
    if zone_checked:
        params["key_zone"] = None
    cursor = psycopg.ClientCursor(conn)
    cursor.execute(query("decide", spec.environment.schema), params)
    cursor.nextset()
    found = cursor.fetchone()
    assert found is not None
    row = json.loads(found[0])  # the decide query's one JSON text: cheaper than 21 columns
    decision = row["decision"]
    if decision == "zone":
        zone = run.trigger.key_zone
        assert zone is not None
        refuse_zone_change(run.job_name, run.run_key, zone, row["zone_conflicts"])
        conn.execute("ROLLBACK")  # the same zone written another way: decide again
        return decide(conn, spec, records, zone_checked=True)
    if decision == "shared":
        raise shared_session_error(row["backend_pid"], run.lock_key)
    if decision in ("locked", "leased"):  # leased: migration 22
        return Decision(None, None, None, leased=decision == "leased")
    existing = decided_run(run.job_name, run.run_key, row) if row["run_found"] else None
    lock = RunLock(run.lock_key, row["backend_pid"], row["holder"])
    return Decision(lock, existing, row["noop_attempt_id"])


_START_WATCH = SlowStepWatch(START_WAIT_WARNING)
os.register_at_fork(after_in_child=_START_WATCH.reset)


def _warn_start_waits(logger: RunLogger) -> None:
    logger.warning(
        "the start has waited %d s for the job database: either a transaction of an earlier "
        "attempt of this key is still open (a worker cut off from the database: the server "
        "ends it within the dead-peer bound, about a minute), or a connection pooler has no "
        "server connection free (its pool is exhausted: see docs/deploying.md, pool sizing)",
        START_WAIT_WARNING,
    )


class Run:
    """One call of :func:`~airflow_idempotency.runner.run_idempotently`; its methods are the
    steps of runner's module doc."""

    def __init__(self, spec: RunSpec, work: Work) -> None:
        self.spec = spec
        self.work = work
        self.records = RunRecords(spec.environment.schema, spec.run)
        self.log = RunLogger(spec.environment.logger or log, spec.run.job_name, spec.run.run_key)
        self.attempt_id: int | None = None
        self.began = time.monotonic()

    @property
    def job_name(self) -> str:
        return self.spec.run.job_name

    @property
    def run_key(self) -> str:
        return self.spec.run.run_key

    @property
    def options(self) -> RunOptions:
        return self.spec.options

    @property
    def schema(self) -> str:
        return self.spec.environment.schema

    def _count(self, outcome: str) -> None:
        metrics.run_outcome(self.spec.environment.metrics, outcome, self.job_name)

    def _decided(self) -> None:
        """The decision is taken (refuse, no-op, or run the work): time it."""
        elapsed = time.monotonic() - self.began
        metrics.run_timing(self.spec.environment.metrics, "decision", elapsed, self.job_name)

    def execute(self) -> RunResult:
        try:
            return self._execute()
        except psycopg.errors.InsufficientPrivilege as exc:
            missing = _privilege_refusal(self.spec.connect, self.schema, exc)
            if missing is None:
                raise  # the work's own statement: its tables, its grants
            raise missing from exc
        except psycopg.Error as exc:
            refusal = pooler_refusal(exc)
            if refusal is None:
                raise
            raise refusal from exc

    def _execute(self) -> RunResult:
        with autocommit_connection(self.spec.connect) as lock_conn:
            ensure_schema(lock_conn, self.schema)
            with lock_transaction(lock_conn):
                decided = self._bounded(
                    "the decision of", decide, lock_conn, self.spec, self.records
                )
                if decided.lock is None:
                    refusal = self._bounded(
                        "recording the refusal of",
                        self._record_lock_held,
                        lock_conn,
                        decided.leased,
                    )
                else:
                    crash_point("runner.after_lock")
                    if decided.noop_attempt_id is not None:
                        assert decided.existing is not None
                        lock_conn.commit()  # the noop attempt and the lock's release
                        self.attempt_id = decided.noop_attempt_id
                        return self._noop_result(decided.existing)
                    return self._run(lock_conn, decided.lock, decided.existing)
            raise refusal  # after the lock transaction committed the lock_held attempt

    # -- 1. lock (when another session holds it) ------------------------------------------

    def _record_lock_held(
        self, conn: psycopg.Connection, leased: bool = False, and_commit: bool = True
    ) -> RunLockedError:
        """Record the refusal: ``leased``, the key's live lease names the holder (the lease
        mode's decision, or the advisory mode's of a completed key under a live lease), else
        (or when it has none) the session holding the key's advisory run lock."""
        lock_key = self.spec.run.lock_key
        found = describe_lease(conn, self.schema, lock_key) if leased else None
        if found is None:
            holder = describe_holder(conn, self.schema, lock_key)
            found = holder, format_holder(holder)
        holder, described = found
        return self._refuse(conn, holder, described, and_commit=and_commit)

    def _refuse(
        self,
        conn: psycopg.Connection,
        holder: dict[str, Any],
        described: str,
        *,
        and_commit: bool,
    ) -> RunLockedError:
        """Record the ``lock_held`` attempt (``described`` names the holder), log and count
        it; the error to raise once the recording committed."""
        message = (
            f"job {self.job_name!r} run_key {self.run_key!r} is locked by another execution: "
            f"{described}"
        )
        self.log.attempt = self.records.insert_attempt(
            conn,
            "lock_held",
            lock=None,
            options=self.options,
            error=message,
            details={"holder": json.loads(json.dumps(holder, default=str))},
            and_commit=and_commit,
        )
        self.log.warning("%s", message)
        self._decided()
        self._count("lock_held")
        return RunLockedError(message, holder=holder)

    # -- 2. the no-op (the lease mode records it itself) -----------------------------------

    def _noop(
        self, conn: psycopg.Connection, lock: RunLock, existing: RunRecord, and_commit: bool
    ) -> RunResult:
        """Record the ``noop`` attempt, log and count it; pass the completed run's counts on."""
        completed_at = existing.completed_at.isoformat() if existing.completed_at else None
        self.attempt_id = self.records.insert_attempt(
            conn,
            "noop",
            lock=lock,
            options=self.options,
            details={"completed_at": completed_at},
            and_commit=and_commit,
        )
        return self._noop_result(existing)

    def _noop_result(self, existing: RunRecord) -> RunResult:
        """The no-op is recorded (``self.attempt_id``): log and count it; pass the completed
        run's counts on."""
        assert self.attempt_id is not None
        self.log.attempt = self.attempt_id
        self._decided()
        self._count("noop")
        self.log.info(
            "found existing completed run (completed %s by %s, %s attempt(s)): no-op. "
            "Set force=true in the run's conf to recompute it.",
            existing.completed_at,
            existing.triggered_by,
            existing.attempt_count,
        )
        return RunResult(
            RunOutcome.NOOP, self.job_name, self.run_key, self.attempt_id, replayed(existing)
        )

    def _result(self, outcome: RunOutcome, counts: dict[str, Any]) -> RunResult:
        """The attempt finished its work (completed, or a dry run rolled back): log and
        count it."""
        assert self.attempt_id is not None
        if outcome is RunOutcome.DRY_RUN:
            self.log.info("dry run finished, rolled back: %s", counts)
        else:
            self.log.info("completed: %s", counts)
        self._count(outcome.value)
        return RunResult(outcome, self.job_name, self.run_key, self.attempt_id, counts)

    def _run(
        self, lock_conn: psycopg.Connection, lock: RunLock, existing: RunRecord | None
    ) -> RunResult:
        try:
            counts = self._start_and_work(lock_conn, lock, existing)
        except CompletedBeforeStart as found:
            return self._noop_result(found.run)  # the lock transaction's COMMIT releases it
        except WorkDeferred:
            assert self.attempt_id is not None  # the work ran: its attempt was started
            record_deferral(lock_conn, self.spec, self.records, self.log, self.attempt_id)
            raise
        except BaseException as exc:
            named = named_failure(lock_conn, exc, self.spec)
            record_failure(lock_conn, named, self.spec, self.records, self.log, self.attempt_id)
            if named is exc:
                raise
            raise named from exc
        if self.options.dry_run:
            assert self.attempt_id is not None
            self.records.finish_attempt(
                lock_conn, self.attempt_id, "dry_run", details={"counts": counts}
            )
            return self._result(RunOutcome.DRY_RUN, counts)
        crash_point("runner.before_completion")
        return self._complete(lock_conn, lock, counts)

    # -- 3. start and 4. work ---------------------------------------------------------------

    def _start_and_work(
        self, lock_conn: psycopg.Connection | None, lock: RunLock, existing: RunRecord | None
    ) -> dict[str, Any]:
        """Record the attempt on a new work connection, then run the work with it."""
        with contextlib.ExitStack() as stack:  # closes the connection, rolls back a dry run
            conn = stack.enter_context(autocommit_connection(self.spec.connect, work=True))
            if conn is lock_conn:
                raise ValueError(
                    "connect() returned the lock connection again: it must open (or lend "
                    "from a pool) a different connection on every call, since the lock "
                    "transaction stays open on the first one for the whole run"
                )
            self._start(conn, lock, existing)
            if self.options.dry_run:
                # One outer transaction, rolled back at the end: every transaction() of the
                # work becomes a savepoint inside it, so later steps still see earlier writes.
                stack.enter_context(conn.transaction(force_rollback=True))
            assert self.attempt_id is not None
            ctx = RunContext(
                self.spec,
                attempt_id=self.attempt_id,
                lock=lock,
                connection=conn,
                log=self.log,
                lock_connection=lock_conn,
            )
            self._decided()
            started = time.monotonic()
            try:
                return storable_counts(self.work(ctx))
            except psycopg.Error as exc:
                # the fence refused the COMMIT of a transaction of the work's own around a
                # fenced one (or its PREPARE): say so, as run.transaction() does
                if not fence_sqlstate(exc):
                    raise
                raise ctx.translate_error(exc, conn) from exc
            finally:
                elapsed = time.monotonic() - started
                metrics.run_timing(self.spec.environment.metrics, "work", elapsed, self.job_name)

    def _start(self, conn: psycopg.Connection, lock: RunLock, existing: RunRecord | None) -> None:
        """Record this execution, committed at once (the lock transaction stays open).

        The start takes the key over from the fence first: it waits until no transaction of
        an earlier attempt is still open (records.start_attempt). A run completed by then
        (its completion landed after the decision read it) is not taken over unless forced:
        :class:`CompletedBeforeStart`, the run ends as a no-op.
        """
        with _START_WATCH.watching(functools.partial(_warn_start_waits, self.log)):
            started = self._bounded(
                "the start of", self.records.start_attempt, conn, lock, self.options
            )
        self.attempt_id = self.log.attempt = started.attempt_id
        if started.completed is not None:
            raise CompletedBeforeStart(started.completed)  # recorded as a no-op: no work
        count, abandoned = started.attempt_count, started.abandoned
        if self.options.dry_run:
            self.log.info(
                "dry run: work runs in a transaction that is rolled back; job_runs untouched"
            )
            return
        if abandoned:
            self._count("takeover")
        previous = existing.status if existing else "new"
        self.log.info("started (previous status: %s, attempt #%d of this key)", previous, count)
        crash_point("runner.after_started")

    def _bounded(self, step: str, call: Callable[..., _T], *args: Any) -> _T:
        """``call(*args)``, one of the run's own steps: a bounded lock wait of it that ended is
        raised as :class:`LockWaitError`, naming who held what."""
        try:
            return call(*args)
        except psycopg.Error as exc:
            refusal: IdempotencyError | None = self._lock_wait(exc, step)
            if refusal is None and fence_refused(exc):
                refusal = LockLostError(
                    f"{step} job {self.job_name!r} run_key {self.run_key!r} was refused by the "
                    f"fence: {exc.diag.message_primary}. Nothing of it was written. A rerun "
                    "will pick the key up again."
                )
            if refusal is None:
                raise
            raise refusal from exc

    def _lock_wait(self, exc: psycopg.Error, step: str) -> LockWaitError | None:
        """The error for a bounded lock wait of ``step`` that ended, naming who held the
        bookkeeping tables (asked on a new connection: the waiting one is aborted)."""
        holders: list[str] = []
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            with (
                contextlib.suppress(psycopg.Error, IdempotencyError),
                autocommit_connection(self.spec.connect) as conn,
            ):
                holders = bookkeeping_lock_holders(conn, self.schema)
        what = f"{step} job {self.job_name!r} run_key {self.run_key!r}"
        return lock_wait_refusal(exc, what, holders)

    # -- 5. fenced completion ---------------------------------------------------------------

    def _complete(
        self, lock_conn: psycopg.Connection, lock: RunLock, counts: dict[str, Any]
    ) -> RunResult:
        """Mark the run completed in the lock transaction and commit: one instant for both."""
        assert self.attempt_id is not None
        try:
            done = self.records.complete_attempt(
                lock_conn,
                self.attempt_id,
                lock,
                counts,
                and_commit=True,  # the completion and the lock's release, at one instant
            )
            if not done:
                raise LockLostError(
                    f"job {self.job_name!r} run_key {self.run_key!r}: attempt {self.attempt_id} "
                    "finished its work but no longer owns the run or its lock, so it may not "
                    "mark it completed. Another attempt took over or the lock session ended; "
                    "rerun to converge."
                )
        except psycopg.errors.LockNotAvailable as exc:
            waited = self._lock_wait(exc, "the completion of")
            assert waited is not None
            record_failure(lock_conn, waited, self.spec, self.records, self.log, self.attempt_id)
            raise waited from exc
        except (psycopg.OperationalError, LockLostError) as exc:
            lost = (
                exc
                if isinstance(exc, LockLostError)
                else LockLostError(
                    f"job {self.job_name!r} run_key {self.run_key!r}: the lock connection was "
                    f"lost as the completion was sent ({exc}): its COMMIT may have landed or "
                    "not. A rerun converges (a no-op if it landed)."
                )
            )
            record_failure(lock_conn, lost, self.spec, self.records, self.log, self.attempt_id)
            raise lost from exc
        return self._result(RunOutcome.COMPLETED, counts)
