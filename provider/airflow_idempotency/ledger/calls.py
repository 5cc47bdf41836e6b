"""One effect's call to its remote: its first try, then its retries.

Each try notes whether the remote answered at all (:mod:`.reachability`); the retries are
:mod:`.retries`.
"""

from __future__ import annotations

from typing import Any

from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import (
    OutcomeUnknownError,
    PermanentRemoteError,
    TransientRemoteError,
)
from airflow_idempotency.ledger.outcomes import NOT_SENT, UNREACHABLE, Outcome, pending
from airflow_idempotency.ledger.reachability import Reachability
from airflow_idempotency.ledger.retries import Retries, retry
from airflow_idempotency.ledger.scope import LockWatch
from airflow_idempotency.ledger.senders import Confirmation, ConnectionPool, Effect, EffectSender


class Calls:
    """The calls of one export: how each is tried (``retries``), and what stops the next
    one (the lock lost, seen by ``watch``; the remote down, seen by ``reach``)."""

    def __init__(self, retries: Retries, watch: LockWatch, reach: Reachability) -> None:
        self.retries = retries
        self.watch = watch
        self.reach = reach

    def stopped(self, sender: EffectSender[Any]) -> str | None:
        """Why no call of ``sender`` may begin now, or ``None``.

        A deduplicating remote is called only while the lock is held (checked at most every
        ``lock_check_interval``). For one that does not deduplicate, the intent recorded
        just before (fenced) is the check.
        """
        if sender.deduplicating and not self.watch.held():
            return NOT_SENT
        if self.reach.down:
            return UNREACHABLE
        return None

    async def call(
        self, pool: ConnectionPool[Any], sender: EffectSender[Any], effect: Effect
    ) -> Outcome:
        """One effect: its first try, then retries of transient errors.

        For a remote that does not deduplicate, an :class:`OutcomeUnknownError` ends the call
        at once: the effect is unknown and is not tried again.
        """
        key = effect.idempotency_key
        crash_point("ledger.before_remote_call")
        if (reason := self.stopped(sender)) is not None:
            return pending(key, reason)
        try:
            # Most calls succeed at once: only a transient error pays for the retry loop.
            async with pool.connection() as connection:
                confirmation = await self.send(connection, sender, effect)
        except OutcomeUnknownError as exc:
            if not sender.deduplicating:
                return Outcome(key, "unknown", None, f"outcome unknown: {exc}", 1)
            return await self._retry(pool, sender, effect, exc)
        except TransientRemoteError as exc:
            return await self._retry(pool, sender, effect, exc)
        except PermanentRemoteError as exc:
            return Outcome(key, "failed", None, str(exc), 1)
        crash_point("ledger.after_remote_commit")
        return Outcome(key, "succeeded", confirmation.reference, None, 1, confirmation.replayed)

    async def _retry(
        self,
        pool: ConnectionPool[Any],
        sender: EffectSender[Any],
        effect: Effect,
        first_error: TransientRemoteError,
    ) -> Outcome:
        async def again() -> Confirmation:
            async with pool.connection() as connection:
                return await self.send(connection, sender, effect)

        return await retry(
            self.retries,
            effect.idempotency_key,
            first_error,
            again,
            lambda: self.stopped(sender),
            deduplicating=sender.deduplicating,
        )

    async def send(
        self, connection: Any, sender: EffectSender[Any], effect: Effect
    ) -> Confirmation:
        """One try of one call, noting whether the remote answered at all."""
        try:
            confirmation = await sender.send(connection, effect)
        except TransientRemoteError as exc:
            if exc.unreachable:
                self.reach.no_answer(str(exc))
            else:
                self.reach.answered()
            raise
        except PermanentRemoteError:
            self.reach.answered()
            raise
        self.reach.answered()
        return confirmation
