"""The lease lock mode's run: the steps of run_steps.Run, no connection held for the run.

:class:`LeaseRun` is :func:`~airflow_idempotency.runner.run_idempotently`'s run when its
``lock_mode`` is ``"lease"`` (:mod:`~airflow_idempotency.leases`): the lease taken (or the
refusal recorded) and the run read on a connection borrowed for the decision; the start, the
work's transactions, the completion or the failure each on a connection of its own, fenced by
the lease (:class:`~airflow_idempotency.fence.Fence`); the lease renewed meanwhile by a
heartbeat and released at the end. The start and the work are the advisory mode's own.
"""

from __future__ import annotations

from typing import Any

import psycopg

from airflow_idempotency import records
from airflow_idempotency._sql import query_row
from airflow_idempotency._transactions import bounded_transaction
from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import IdempotencyError, LockLostError, RunLockedError
from airflow_idempotency.fence import Fence
from airflow_idempotency.key_zone import check_key_zone
from airflow_idempotency.leases import LeaseHeartbeat, acquire_lease, release_lease
from airflow_idempotency.locks import RunLock
from airflow_idempotency.records import RunRecord
from airflow_idempotency.run_context import autocommit_connection
from airflow_idempotency.run_failures import named_failure, record_deferral, record_failure
from airflow_idempotency.run_steps import (
    Run,
    RunOutcome,
    RunResult,
    WorkDeferred,
    describe_holder,
    format_holder,
    log,
)
from airflow_idempotency.schema import ensure_schema


class LeaseRun(Run):
    """One call of :func:`~airflow_idempotency.runner.run_idempotently` in the lease mode."""

    def _execute(self) -> RunResult:
        """The steps in the lease mode: the lease taken (or the refusal recorded) and the run
        read on a connection borrowed for the decision; the start, the work's transactions,
        the completion or the failure each on a connection of its own, fenced by the lease;
        the lease renewed meanwhile by a heartbeat, released at the end."""
        run = self.spec.run
        with autocommit_connection(self.spec.connect) as conn:
            ensure_schema(conn, self.schema)
            check_key_zone(conn, self.schema, run.job_name, run.run_key, run.trigger.key_zone)
            lease = self._bounded("taking the lease of", self._acquire_lease, conn)
            if lease is None:
                raise self._bounded("recording the refusal of", self._record_lease_held, conn)
            try:
                crash_point("runner.after_lock")
                existing = self._bounded("reading the run record of", self._read_lease, conn)
            except BaseException:
                self._release(lease)
                raise
        heartbeat = LeaseHeartbeat(
            lease,
            lambda: autocommit_connection(self.spec.connect),
            schema=self.schema,
            ttl=self.spec.lease_ttl,
            logger=self.spec.environment.logger or log,
        )
        try:
            with heartbeat:
                if existing and existing.status == "completed" and not self.options.force:
                    noop = self._noop_lease
                    return self._bounded("recording the no-op of", noop, lease, existing)
                return self._run_lease(lease, existing)
        finally:
            self._release(lease)

    def _acquire_lease(self, conn: psycopg.Connection) -> RunLock | None:
        lock_key, ttl = self.spec.run.lock_key, self.spec.lease_ttl
        return acquire_lease(conn, lock_key, schema=self.schema, ttl=ttl)

    def _read_lease(self, conn: psycopg.Connection) -> RunRecord | None:
        return records.get_run(conn, self.schema, self.job_name, self.run_key)

    def _record_lease_held(self, conn: psycopg.Connection) -> RunLockedError:
        """A lease refused: the holder is a lease of another worker, or an advisory lock."""
        row = query_row(conn, "lease_holder", self.schema, {"lock_key": self.spec.run.lock_key})
        holder: dict[str, Any]
        if row:
            holder = {k: v for k, v in row.items() if not k.startswith("attempt_")}
            if row["attempt_attempt_id"] is not None:
                holder["attempt"] = {
                    k.removeprefix("attempt_"): v
                    for k, v in row.items()
                    if k.startswith("attempt_")
                }
            described = (
                f"lease token {row['token']} of worker {row['holder']}, taken "
                f"{row['acquired_at'].isoformat()}, expires {row['expires_at'].isoformat()}"
                " unless renewed"
            )
            attempt = holder.get("attempt")
            if attempt:
                described += (
                    f" (attempt {attempt['attempt_id']}, dag {attempt['dag_id']} run "
                    f"{attempt['run_id']}, started {attempt['started_at'].isoformat()})"
                )
        else:
            holder = describe_holder(conn, self.schema, self.spec.run.lock_key)
            described = format_holder(holder)
        return self._refuse(conn, holder, described, and_commit=False)

    def _noop_lease(self, lease: RunLock, existing: RunRecord) -> RunResult:
        with autocommit_connection(self.spec.connect) as conn:
            return self._noop(conn, lease, existing, False)

    def _fence(self, lease: RunLock) -> Fence:
        assert self.attempt_id is not None
        return Fence(lease, self.attempt_id, self.schema, self.job_name, self.run_key)

    def _run_lease(self, lease: RunLock, existing: RunRecord | None) -> RunResult:
        try:
            counts = self._start_and_work(None, lease, existing)
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

    def _complete_lease(self, lease: RunLock, counts: dict[str, Any]) -> RunResult:
        """Mark the run completed in a fenced transaction (checked at BEGIN and at COMMIT
        against the lease); the lease is released after it commits."""
        assert self.attempt_id is not None
        fence = self._fence(lease)
        try:
            with autocommit_connection(self.spec.connect) as conn:
                try:
                    with fence.transaction(conn, bound_locks=True):
                        done = self.records.complete_attempt_lease(conn, self.attempt_id, counts)
                        if not done:
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
        except (psycopg.Error, IdempotencyError) as exc:
            failure: BaseException = exc
            if isinstance(exc, psycopg.OperationalError):
                failure = LockLostError(
                    f"job {self.job_name!r} run_key {self.run_key!r}: the connection was lost "
                    f"before the completion could be recorded ({exc}); it is not marked "
                    "completed and a rerun converges."
                )
            record_failure(None, failure, self.spec, self.records, self.log, self.attempt_id, fence)
            if failure is exc:
                raise
            raise failure from exc
        return self._result(RunOutcome.COMPLETED, counts)

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
