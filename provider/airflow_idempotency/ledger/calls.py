"""One effect's call to its remote: its first try, then its retries.

Each try notes whether the remote answered at all (:mod:`.reachability`); the retries are
:mod:`.retries`. What both ways of making a claimed batch's calls share (the deduplicating
batches, the pipeline) is :class:`DeliveryPath`.
"""

from __future__ import annotations

import abc
from typing import Any

import psycopg

from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import (
    OutcomeUnknownError,
    PermanentRemoteError,
    TransientRemoteError,
)
from airflow_idempotency.ledger.outcomes import (
    NOT_SENT,
    UNREACHABLE,
    LedgerSummary,
    Outcome,
    pending,
)
from airflow_idempotency.ledger.reachability import Reachability
from airflow_idempotency.ledger.retries import Retries, retry
from airflow_idempotency.ledger.scope import LedgerScope, LockWatch
from airflow_idempotency.ledger.senders import (
    BlockingEffectSender,
    Confirmation,
    ConnectionPool,
    Effect,
    EffectSender,
)


class Calls:
    """The calls of one export: how each is tried (``retries``), and what stops the next
    one (the lock lost, seen by ``watch``; the remote down, seen by ``reach``)."""

    def __init__(self, retries: Retries, watch: LockWatch, reach: Reachability) -> None:
        self.retries = retries
        self.watch = watch
        self.reach = reach

    def stopped(self, sender: EffectSender[Any]) -> str | None:
        """Why no call of ``sender`` may begin now, or ``None``; asked right before each call
        (once its connection is in hand).

        Every call first looks at the lock session (no round trip: a session the server
        ended is seen at once). A deduplicating remote's call also has the database re-check
        the lock, at most every ``lock_check_interval``; for one that does not deduplicate,
        the intent recorded just before (fenced) is that check (and this runs in a worker
        thread, which may not use the ledger's connection).
        """
        if sender.deduplicating and not self.watch.held():
            return NOT_SENT
        if not sender.deduplicating and self.watch.ended():
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
        if self.reach.down or self.watch.lost:  # no wait for a connection then
            return pending(key, UNREACHABLE if self.reach.down else NOT_SENT)
        try:
            # Most calls succeed at once: only a transient error pays for the retry loop.
            answer = await self._try(pool, sender, effect)
        except OutcomeUnknownError as exc:
            if not sender.deduplicating:
                return Outcome(key, "unknown", None, f"outcome unknown: {exc}", 1)
            return await self._retry(pool, sender, effect, exc)
        except TransientRemoteError as exc:
            return await self._retry(pool, sender, effect, exc)
        except PermanentRemoteError as exc:
            return Outcome(key, "failed", None, str(exc), 1)
        if isinstance(answer, str):
            return pending(key, answer)
        crash_point("ledger.after_remote_commit")
        return Outcome(key, "succeeded", answer.reference, None, 1, answer.replayed)

    async def _try(
        self, pool: ConnectionPool[Any], sender: EffectSender[Any], effect: Effect
    ) -> Confirmation | str:
        """One try, on a connection of the pool: the confirmation, or why it was not made
        (the checks of :meth:`stopped`, once the connection is in hand: a call that waited
        for one is checked when it would begin, not when it was queued)."""
        async with pool.connection() as connection:
            if (reason := self.stopped(sender)) is not None:
                return reason
            return await self.send(connection, sender, effect)

    async def _retry(
        self,
        pool: ConnectionPool[Any],
        sender: EffectSender[Any],
        effect: Effect,
        first_error: TransientRemoteError,
    ) -> Outcome:
        return await retry(
            self.retries,
            effect.idempotency_key,
            first_error,
            lambda: self._try(pool, sender, effect),
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


class DeliveryPath(abc.ABC):
    """How the calls of each claimed batch of one export are made: the deduplicating batches
    (:mod:`.deduplicating`) or the pipeline (:mod:`.pipeline`); ``send_all`` picks one.

    ``size`` is the number of calls in flight at once (connections, or workers)."""

    def __init__(
        self,
        run: LedgerScope,
        remote_system: str,
        calls: Calls,
        sender: EffectSender[Any] | BlockingEffectSender[Any],
        size: int,
    ) -> None:
        self.run = run
        self.remote_system = remote_system
        self.calls = calls
        self._open(sender, size)

    @abc.abstractmethod
    def _open(self, sender: EffectSender[Any] | BlockingEffectSender[Any], size: int) -> None:
        """Get ready to make ``size`` calls at once through ``sender``."""

    @abc.abstractmethod
    async def send(
        self, conn: psycopg.Connection, to_send: list[Effect], summary: LedgerSummary
    ) -> None:
        """Make the calls of a claimed batch and write their outcomes (into ``summary`` too)."""

    @abc.abstractmethod
    async def close(self, *, abandon: bool) -> None:
        """Release what :meth:`_open` took, once the calls in progress end."""
