"""The lease lock mode's run: the steps of run_steps.Run, no connection held for the run.

:class:`LeaseRun` is :func:`~airflow_idempotency.runner.run_idempotently`'s run when its
``lock_mode`` is ``"lease"`` (:mod:`~airflow_idempotency.leases`): the lease taken (or the
refusal recorded) and the run read on a connection borrowed for the decision; the start, the
work's transactions, the completion or the failure each on a connection of its own, fenced by
the lease (:class:`~airflow_idempotency.fence.Fence`); the lease renewed meanwhile by a
heartbeat and released at the end. The start and the work are the advisory mode's own.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any, NoReturn

import psycopg
from psycopg.types.json import Jsonb

from airflow_idempotency import metrics
from airflow_idempotency._sql import query
from airflow_idempotency._transactions import (
    bounded_transaction,
    in_one_transaction,
    pipelined,
    rollback_quietly,
)
from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import (
    ConfigurationError,
    IdempotencyError,
    LockLostError,
    RunLockedError,
)
from airflow_idempotency.fence import Fence
from airflow_idempotency.key_zone import refuse_zone_change
from airflow_idempotency.leases import (
    WAIT_NOTICE_SECONDS,
    LeaseHeartbeat,
    lease_token,
    release_lease,
    shared_session_error,
    worker_name,
)
from airflow_idempotency.locks import LOCK_WAIT_ENV, RunLock, lock_wait_ms, pooler_refusal
from airflow_idempotency.records import RunRecord, RunRecords, decided_run
from airflow_idempotency.run_context import (
    ConnectionFactory,
    RunSpec,
    autocommit_connection,
    connect_when_room,
)
from airflow_idempotency.run_failures import named_failure, record_deferral, record_failure
from airflow_idempotency.run_steps import (
    CompletedBeforeStart,
    Run,
    RunOutcome,
    RunResult,
    WorkDeferred,
    log,
)
from airflow_idempotency.schema import ensure_schema


@dataclasses.dataclass(frozen=True)
class LeaseDecision:
    """What the lease mode's decision found: ``outcome`` (``run``: the lease taken; ``noop``:
    a completed key, its no-op recorded without a lease; ``locked``: another worker's lease or
    an advisory lock holds the key), the lease, the key's run record, the no-op's attempt."""

    outcome: str
    lease: RunLock | None = None
    existing: RunRecord | None = None
    noop_attempt_id: int | None = None


def decide_lease(
    conn: psycopg.Connection, spec: RunSpec, records: RunRecords, zone_checked: bool = False
) -> LeaseDecision:
    """Decide in one round trip on the idle autocommit ``conn``: the zone rule, the lease taken
    or refused, the key's run record, a completed key's no-op recorded (without a lease), in
    one transaction committed in the same message (migration 19's run_decide_lease)."""
    run = spec.run
    lease = {"holder": worker_name(), "ttl": str(spec.lease_ttl), "lock_wait_ms": lock_wait_ms()}
    params = records.decision_params(spec.options, lease)
    if zone_checked:
        params["key_zone"] = None
    cursor = psycopg.ClientCursor(conn)
    try:
        cursor.execute(query("decide_lease", spec.environment.schema), params)
        cursor.nextset()
        found = cursor.fetchone()
    except BaseException:
        rollback_quietly(conn)
        raise
    assert found is not None
    row = json.loads(found[0])  # one JSON text, as the decide query's
    decision = row["decision"]
    if decision == "zone":
        zone = run.trigger.key_zone
        assert zone is not None
        refuse_zone_change(run.job_name, run.run_key, zone, row["zone_conflicts"])
        return decide_lease(conn, spec, records, zone_checked=True)  # the same zone, spelled
    if decision == "shared":
        raise shared_session_error(run.lock_key)
    if decision == "locked":
        return LeaseDecision("locked")
    existing = decided_run(run.job_name, run.run_key, row) if row["run_found"] else None
    if decision == "noop":
        return LeaseDecision("noop", existing=existing, noop_attempt_id=row["noop_attempt_id"])
    lease_lock = RunLock(run.lock_key, 0, f"lease:{row['token']}", lost=threading.Event())
    return LeaseDecision("run", lease_lock, existing)


class LeaseRun(Run):
    """One call of :func:`~airflow_idempotency.runner.run_idempotently` in the lease mode."""

    _released = False  # the completion released the lease at its COMMIT
    _completion_sent = False  # a try of the completion sent its statements (and may have landed)
    _taken: RunLock | None = None  # the lease, once the decision committed it
    _heartbeat: LeaseHeartbeat | None = None

    def _execute(self) -> RunResult:
        """The steps in the lease mode: the decision in one round trip on a connection
        borrowed for it (the lease taken, or the refusal recorded, or a completed key's no-op
        recorded without a lease); the start, the work's transactions, the completion (which
        releases the lease at its COMMIT) or the failure each on a connection of its own,
        fenced by the lease; the lease renewed meanwhile by a heartbeat."""
        try:
            with autocommit_connection(self.spec.connect) as conn:
                ensure_schema(conn, self.schema)
                decided = self._bounded("the decision of", self._decide, conn)
                if decided.outcome == "locked":
                    raise self._bounded("recording the refusal of", self._record_lease_held, conn)
        except BaseException:
            if self._taken is not None:  # the lease was taken, then giving the connection
                self._release(self._taken)  # back (or timing the decision) failed: it goes
            raise
        if decided.outcome == "noop":
            assert decided.existing is not None and decided.noop_attempt_id is not None
            self.attempt_id = decided.noop_attempt_id
            crash_point("runner.after_lock")
            return self._noop_result(decided.existing)
        lease = decided.lease
        assert lease is not None
        try:
            crash_point("runner.after_lock")
            self._heartbeat = LeaseHeartbeat(
                lease,
                lambda: autocommit_connection(self.spec.connect),
                schema=self.schema,
                ttl=self.spec.lease_ttl,
                logger=self.spec.environment.logger or log,
                report=self._database_wait,
            )
            with self._heartbeat:
                return self._run_lease(lease, decided.existing)
        finally:
            if not self._released:
                self._release(lease)

    def _decide(self, conn: psycopg.Connection) -> LeaseDecision:
        """Decide (:func:`decide_lease`); a run that waited for the database first (behind a
        pooler, its turn in the queue of a busy pool) says so, and the wait is timed."""
        began = time.monotonic()
        try:
            decided = decide_lease(conn, self.spec, self.records)
            self._taken = decided.lease
            return decided
        finally:
            waited = time.monotonic() - began
            self._database_wait(waited)
            if waited >= WAIT_NOTICE_SECONDS:
                self.log.info(
                    "waited %.1f s for the job database before taking the lease: its "
                    "connection pool was busy (runs beyond the pool's size wait their turn, "
                    "up to the pooler's query_wait_timeout; see docs/deploying.md, pool sizing)",
                    waited,
                )

    def _database_wait(self, seconds: float) -> None:
        metrics.run_timing(self.spec.environment.metrics, "database_wait", seconds, self.job_name)

    def _record_lease_held(self, conn: psycopg.Connection) -> RunLockedError:
        """A lease refused: the holder is a lease of another worker, or an advisory lock (the
        refusal recorded outside any transaction: the decision committed)."""
        return self._record_lock_held(conn, leased=True, and_commit=False)

    def _fence(self, lease: RunLock) -> Fence:
        assert self.attempt_id is not None
        return Fence(lease, self.attempt_id, self.schema, self.job_name, self.run_key)

    def _run_lease(self, lease: RunLock, existing: RunRecord | None) -> RunResult:
        try:
            counts = self._start_and_work(None, lease, existing)
        except CompletedBeforeStart as found:
            return self._noop_result(found.run)  # _execute releases the lease
        except WorkDeferred:
            assert self.attempt_id is not None  # the work ran: its attempt was started
            deferred = self._fence(lease)
            record_deferral(None, self.spec, self.records, self.log, self.attempt_id, deferred)
            raise
        except BaseException as exc:
            named = named_failure(None, exc, self.spec, lease)
            fence = self._fence(lease) if self.attempt_id is not None else None
            record_failure(None, named, self.spec, self.records, self.log, self.attempt_id, fence)
            if named is exc:
                raise
            raise named from exc
        if self.options.dry_run:
            assert self.attempt_id is not None
            with (
                autocommit_connection(self.spec.connect) as conn,
                bounded_transaction(conn, self.schema),
            ):
                self.records.finish_attempt(
                    conn, self.attempt_id, "dry_run", details={"counts": counts}
                )
            return self._result(RunOutcome.DRY_RUN, counts)
        crash_point("runner.before_completion")
        return self._complete_lease(lease, counts)

    def _complete_and_release(
        self, conn: psycopg.Connection, fence: Fence, counts: dict[str, Any]
    ) -> bool:
        """Mark the run completed in a fenced transaction (fence_enter at its BEGIN, the
        fence's check at its COMMIT) that releases the lease at that COMMIT, after the check
        (migration 19), its statements pipelined: one round trip. (Pipelined, not one
        simple-protocol message: the fence's check must see its COMMIT as the statement it
        runs in, migration 10.) ``False`` (nothing written, the lease kept) when this attempt
        no longer owns the run."""
        assert self.attempt_id is not None and self._heartbeat is not None
        fence.refuse_if_known_lost()
        params = {
            **fence.params(conn),
            **self.spec.run.key_params,
            "details": Jsonb(counts),
            "token": lease_token(fence.lock),
        }
        names = (
            "fence_enter",
            "bound_lock_waits",
            "complete_attempt_lease",
            "fence_arm",
            "lease_release_at_commit",
        )
        self._heartbeat.releasing()
        self._completion_sent = True
        try:
            with pipelined(conn):
                conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
                cursors = [conn.execute(query(name, self.schema), params) for name in names]
                conn.execute("COMMIT")
        except BaseException:
            rollback_quietly(conn)
            raise
        self._released = cursors[2].fetchone() is not None
        return self._released

    def _complete_lease(self, lease: RunLock, counts: dict[str, Any]) -> RunResult:
        """Mark the run completed in a fenced transaction (checked at BEGIN and at COMMIT
        against the lease), which releases the lease at its COMMIT.

        A completion whose connection is lost (a failover as it runs; PgBouncer dropping it
        while the server is down: query_wait_timeout, server login failing) is tried again on a
        new connection, within the lock wait: the lease fences it, so a second try cannot
        complete the run twice; when the lost one's COMMIT landed after all (the lease is then
        gone and the second try refused), the attempt's recorded outcome says so: it is read
        as soon as a try that sent its statements is lost, past the lock wait too (adv34). A
        try whose connection was refused sent nothing: no outcome is read back for it."""
        assert self.attempt_id is not None
        fence = self._fence(lease)
        deadline = time.monotonic() + int(lock_wait_ms()) / 1000
        lost: BaseException | None = None
        unread: Exception | None = None  # why a lost try's outcome could not be read
        while True:
            try:
                self._complete_once(fence, counts, deadline)
                return self._result(RunOutcome.COMPLETED, counts)
            except (psycopg.Error, IdempotencyError) as exc:
                if self._released:  # its COMMIT's reply was read: only the give-back failed
                    self.log.warning("giving the completion's connection back failed: %s", exc)
                    return self._result(RunOutcome.COMPLETED, counts)
                first_lost = lost is None and self._completion_sent and _connection_lost(exc)
                lost = exc if first_lost else lost  # not a connection refused: it sent nothing
                if lost is not None:
                    completed = self._completed_after_all(deadline)
                    if completed is True:
                        self._released = True  # the lost COMMIT released the lease
                        return self._result(RunOutcome.COMPLETED, counts)
                    unread = completed if isinstance(completed, Exception) else None
                if _connection_lost(exc) and time.monotonic() < deadline:
                    if first_lost:
                        self.log.warning(
                            "the connection of the completion was lost (%s): trying it again "
                            "on a new connection, within %s (the lease fences it)",
                            _cause(exc),
                            LOCK_WAIT_ENV,
                        )
                    time.sleep(min(RETRY_PAUSE_SECONDS, max(0.0, deadline - time.monotonic())))
                    continue
                self._fail_completion(exc, fence, None if lost is None else (lost, unread))

    def _complete_once(self, fence: Fence, counts: dict[str, Any], deadline: float) -> None:
        fence.refuse_if_known_lost()  # before waiting for a connection the fence would refuse
        with autocommit_connection(self._completion_connect(deadline)) as conn:
            try:
                if not self._complete_and_release(conn, fence, counts):
                    raise LockLostError(
                        f"job {self.job_name!r} run_key {self.run_key!r}: attempt "
                        f"{self.attempt_id} finished its work but no longer owns the "
                        "run, so it may not mark it completed. Another attempt took "
                        "over; rerun to converge."
                    )
            except psycopg.Error as exc:
                translated = fence.translate_error(exc, conn)
                if isinstance(exc, psycopg.errors.LockNotAvailable):
                    translated = self._lock_wait(exc, "the completion of") or translated
                raise translated from exc

    def _completed_after_all(self, deadline: float) -> bool | Exception:
        """Whether this attempt is recorded completed (a completion whose connection was lost
        after its COMMIT was sent may have committed); the error when that cannot be read.

        Its connection is waited for within the lock wait even when the lease is known lost:
        a COMMIT that landed released the lease, so the heartbeat then finds it gone, and the
        answer is what the run reports (adv34). Its lock wait is bounded as every other's: a
        reader of the table queues behind an ALTER TABLE that waits for a long reader."""
        params = {"attempt_id": self.attempt_id, "lock_wait_ms": lock_wait_ms()}
        try:
            with autocommit_connection(self._completion_connect(deadline, readback=True)) as conn:
                _, read = in_one_transaction(
                    conn,
                    [
                        (query("bound_lock_waits", self.schema), params),
                        (query("attempt_outcome", self.schema), params),
                    ],
                )
                row = read.fetchone()
        except (psycopg.Error, IdempotencyError) as exc:
            return exc
        return row is not None and row[0] == "completed"

    def _fail_completion(
        self,
        exc: BaseException,
        fence: Fence,
        unread: tuple[BaseException, Exception | None] | None = None,
    ) -> NoReturn:
        """Record the completion's failure and raise it; ``unread``: a try lost after it sent
        its COMMIT and why its outcome could not be read (it may have committed: the error
        says so, never that it did not)."""
        failure: BaseException = exc
        refusal = pooler_refusal(exc) if isinstance(exc, psycopg.Error) else None
        if unread is not None and unread[1] is not None:
            failure = LockLostError(
                f"job {self.job_name!r} run_key {self.run_key!r}: the connection of the "
                f"completion was lost after its COMMIT was sent ({_cause(unread[0])}), and "
                f"whether it committed could not be read within {LOCK_WAIT_ENV} "
                f"({_cause(unread[1])}): it may have committed. A rerun converges (a no-op if "
                "it did)."
            )
            exc = _cause(exc)  # not a translation that says the transaction did not commit
        elif refusal is not None:  # no connection for it: the sizing rule, not a lost lock
            failure = refusal
        elif isinstance(exc, psycopg.OperationalError):
            failure = LockLostError(
                f"job {self.job_name!r} run_key {self.run_key!r}: the connection was lost "
                f"before the completion could be recorded ({exc}); it is not marked "
                "completed and a rerun converges."
            )
        record_failure(None, failure, self.spec, self.records, self.log, self.attempt_id, fence)
        if failure is exc:
            raise exc
        raise failure from exc

    def _completion_connect(
        self, deadline: float | None = None, *, readback: bool = False
    ) -> ConnectionFactory:
        """The completion's connection: the work is committed, so a connection refused for want
        of a slot is asked for again, within the lock wait, while the heartbeat keeps the lease
        (:func:`~airflow_idempotency.run_context.connect_when_room`); no longer once the
        heartbeat found the lease lost (the fence would refuse the completion), unless it is
        for reading whether a lost completion committed after all (``readback``)."""
        return connect_when_room(
            self.spec.connect, "the completion (its work is committed)", self.log,
            self._database_wait,
            within=None if deadline is None else deadline - time.monotonic(),
            hopeless=None if readback else self._lease_lost,
        )  # fmt: skip

    def _lease_lost(self) -> str | None:
        """Why a connection for the completion is of no use any more, if it is not."""
        lease = self._taken
        if lease is not None and lease.known_lost:
            return "the heartbeat found the lease lost: the fence would refuse the completion"
        return None

    def _release(self, lease: RunLock) -> None:
        """Release the lease (the run's outcome is recorded, or nothing was); a release that
        fails is logged: the lease then expires within its time to live."""
        try:
            with autocommit_connection(self.spec.connect) as conn:
                release_lease(conn, lease, schema=self.schema)
        except (psycopg.Error, IdempotencyError) as exc:
            self.log.warning(
                "could not release the lease (%s): the key is free again when it expires "
                "(within %g s)",
                exc,
                self.spec.lease_ttl,
            )


RETRY_PAUSE_SECONDS = 0.5  # between tries of a completion whose connection was lost


def _cause(exc: BaseException) -> BaseException:
    """The psycopg error behind ``exc`` (itself, or what a translation was raised from)."""
    return exc if isinstance(exc, psycopg.Error) else (exc.__cause__ or exc)


def _connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or the psycopg error it was translated from) is the connection lost
    or dropped with nothing known of its transaction: no SQLSTATE (closed, reset), a
    connection exception (08: PgBouncer's query_wait_timeout, server login failing) or an
    operator intervention (57P: a shutdown, a crash of another backend)."""
    cause = _cause(exc)
    if not isinstance(cause, psycopg.OperationalError):
        return False
    if isinstance(pooler_refusal(cause), ConfigurationError):  # statement pooling: for good
        return False
    state = cause.sqlstate
    return state is None or state.startswith(("08", "57P"))
