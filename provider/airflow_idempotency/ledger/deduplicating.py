"""A remote that deduplicates (it honours the idempotency key): a batch's calls at once.

The calls of a claimed batch go out concurrently (``concurrency`` connections), and one
statement writes their outcomes. On doubt the next run sends again with the same key, and the
remote acts once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import psycopg

from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.ledger.calls import DeliveryPath
from airflow_idempotency.ledger.outcomes import LedgerSummary, tally, write_outcomes
from airflow_idempotency.ledger.senders import (
    BlockingEffectSender,
    ConnectionPool,
    Effect,
    EffectSender,
    awaited,
)


class DeduplicatingBatches(DeliveryPath):
    """The calls to a deduplicating remote, made on the ledger's event loop over a pool of
    ``size`` connections (a blocking sender's calls in as many executor threads).

    Made on the running event loop (it sets the loop's executor)."""

    def _open(self, sender: EffectSender[Any] | BlockingEffectSender[Any], size: int) -> None:
        if isinstance(sender, BlockingEffectSender):
            executor = concurrent.futures.ThreadPoolExecutor(
                size, thread_name_prefix=f"ledger-{self.remote_system}"
            )
            asyncio.get_running_loop().set_default_executor(executor)
        self.pool = ConnectionPool(awaited(sender, in_threads=True), size)

    async def send(
        self, conn: psycopg.Connection, to_send: list[Effect], summary: LedgerSummary
    ) -> None:
        """Make the calls of a claimed batch; write their outcomes in one statement."""
        pool = self.pool
        outcomes = await asyncio.gather(
            *(self.calls.call(pool, pool.sender, effect) for effect in to_send)
        )
        crash_point("ledger.before_record_outcomes")
        tally(outcomes, summary)
        try:
            write_outcomes(conn, self.run, self.remote_system, outcomes)
        except psycopg.Error as exc:  # e.g. the server ended the session: say so
            raise self.run.translate_error(exc, conn) from exc

    async def close(self, *, abandon: bool) -> None:
        """Close the pool's connections (no call is in progress between batches)."""
        await self.pool.aclose()
