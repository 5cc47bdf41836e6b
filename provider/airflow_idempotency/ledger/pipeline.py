"""A remote that does not deduplicate (SMTP, a chat webhook, a notifier): intent, call, outcome.

A call begins only once a fenced transaction has committed its key as ``unknown``, and the
outcome replaces that after the call. The calls are made by workers (one per connection,
``concurrency`` of them: threads for a blocking sender) while the ledger's thread commits,
one transaction at a time, the outcomes that arrived together with the intents of the next
calls, never more than ``concurrency + INTENTS_AHEAD`` (8) intents ahead of the outcomes
committed. A crash in between leaves the key ``unknown``: the claim returns it, and it is
counted and reported, never sent, until an operator resolves it
(:mod:`airflow_idempotency.effects.resolutions`). So a crash leaves at most
``concurrency + 8`` keys of an export unknown (12 for
:class:`~airflow_idempotency.effects.mail.SmtpSender`'s 4 connections): the calls in flight,
the calls granted and not begun, and the outcomes not yet written. Once the lock is lost no
intent commits and no further call begins; the outcomes received are still written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from airflow_idempotency._sql import query
from airflow_idempotency._transactions import bounded_transaction, rollback_quietly
from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import LockLostError
from airflow_idempotency.ledger.calls import Calls, DeliveryPath
from airflow_idempotency.ledger.claim import pipelined
from airflow_idempotency.ledger.outcomes import (
    NOT_SENT,
    UNREACHABLE,
    LedgerSummary,
    Outcome,
    pending,
    tally,
    write_outcomes,
)
from airflow_idempotency.ledger.senders import (
    BlockingEffectSender,
    ConnectionPool,
    Effect,
    EffectSender,
    awaited,
)

# A remote that does not deduplicate: the intents committed beyond one per connection, at
# most, and so the unknown keys a crash leaves beyond concurrency. Fewer starve the calls
# while a commit (an fsync) is under way: with 8, email through the ledger keeps up with a
# plain smtplib loop (bench/emails.py: ~1.0x; 2 x concurrency there was ~0.85x).
INTENTS_AHEAD = 8


class Pipeline(DeliveryPath):
    """The calls to a remote that does not deduplicate: each claimed batch through the
    workers, each call only after its intent committed."""

    def _open(self, sender: EffectSender[Any] | BlockingEffectSender[Any], size: int) -> None:
        self.workers = _Workers(self.remote_system, self.calls, sender, size)

    async def send(
        self, conn: psycopg.Connection, to_send: list[Effect], summary: LedgerSummary
    ) -> None:
        """Send a claimed batch through the workers (this thread commits meanwhile)."""
        self.workers.start(len(to_send))
        self._deliver(conn, to_send, summary)

    async def close(self, *, abandon: bool) -> None:
        """End the workers once their calls in progress end; ``abandon``: the calls handed
        out and not begun are not made."""
        self.workers.close(abandon=abandon)

    def _deliver(
        self, conn: psycopg.Connection, effects: list[Effect], summary: LedgerSummary
    ) -> None:
        """Send a claimed batch through the workers, each call only after its intent committed.

        This thread commits, in one transaction each time, the outcomes that arrived and the
        intents of the next calls, never more than ``workers.window`` intents ahead of the
        outcomes committed: at any moment at most that many keys of the export are
        ``unknown`` without their outcome (the crash bound of the module doc). The workers go
        on with the calls already granted while it commits. The outcomes of the batch's last
        calls are written together, once every call has ended.
        """
        workers, watch, reach = self.workers, self.calls.watch, self.calls.reach
        todo = deque(effects)
        back = _Returns(workers.done)
        local: list[Outcome] = []  # effects not called (lock lost, remote down): pending
        outstanding = 0  # intents committed whose outcome is not (yet)
        while True:
            if not todo or back.failure is not None or watch.lost or reach.down:
                if todo and back.failure is None:  # not called: pending, saying why
                    reason = NOT_SENT if watch.lost else UNREACHABLE
                    local.extend(pending(e.idempotency_key, reason) for e in todo)
                todo.clear()
                if outstanding == back.ended:  # every call granted has ended
                    break
                back.wait()
                continue
            if outstanding - len(back.outcomes) >= workers.window:  # wait for a call to end
                back.wait()
            else:
                back.poll()
            # While the workers have granted calls to begin, wait for more outcomes (no worker
            # idles meanwhile): fewer, larger commits.
            while len(back.outcomes) < INTENTS_AHEAD and outstanding > back.ended:
                if back.failure is not None or not workers.waiting():
                    break
                back.wait()
            if back.failure is not None or reach.down:
                continue
            room = workers.window - outstanding + len(back.outcomes)
            calls = [todo.popleft() for _ in range(min(room, len(todo)))]
            outstanding -= len(back.outcomes)
            granted, local = self._grant(conn, back.take() + local, calls, summary)
            outstanding += granted
        crash_point("ledger.before_record_outcomes")
        if back.outcomes or local:
            self._grant(conn, back.take() + local, [], summary)
        if back.failure is not None:
            raise back.failure

    def _grant(
        self,
        conn: psycopg.Connection,
        outcomes: list[Outcome],
        calls: list[Effect],
        summary: LedgerSummary,
    ) -> tuple[int, list[Outcome]]:
        """Write ``outcomes`` and the intents of ``calls`` in one transaction, and hand the
        calls granted to the workers; return how many, and the outcomes of the calls refused
        because the lock was lost."""
        granted = self._write_intents(conn, outcomes, [e.idempotency_key for e in calls])
        tally(outcomes, summary)
        refused = []
        for effect in calls:
            if effect.idempotency_key in granted:
                self.workers.hand(effect)
            elif self.calls.watch.lost:
                refused.append(pending(effect.idempotency_key, NOT_SENT))
            else:  # another attempt or an operator moved it meanwhile
                summary.skipped_existing += 1
        return len(granted), refused

    def _write_intents(
        self,
        conn: psycopg.Connection,
        outcomes: list[Outcome],
        keys: list[str],
    ) -> set[str]:
        """Record ``outcomes`` and the intents of ``keys`` in one transaction (fenced when
        there are intents); return the keys that may be called now.

        A lost lock refuses the intents, not the outcomes: those are facts about the remote
        and are written alone then.
        """
        run, watch = self.run, self.calls.watch
        granted: set[str] = set()
        fenced = bool(keys) and not watch.lost
        try:
            with pipelined(conn):
                bounded = bounded_transaction(conn, run.schema)
                with run.fenced_transaction(conn) if fenced else bounded:
                    if outcomes:
                        write_outcomes(conn, run, self.remote_system, outcomes)
                    if fenced:  # no intent commits without the lock
                        cursor = conn.execute(
                            query("ledger_record_intents", run.schema),
                            {
                                "keys": keys,
                                "remote_system": self.remote_system,
                                "attempt_id": run.attempt_id,
                            },
                        )
                if fenced:
                    granted = {key for (key,) in cursor.fetchall()}
        except psycopg.Error as exc:
            lost = run.translate_error(exc, conn)
            if not isinstance(lost, LockLostError):
                raise lost from exc
            rollback_quietly(conn)
            watch.lost = True
            if outcomes:
                if conn.closed or conn.broken:  # every session ended: their keys stay unknown
                    raise lost from exc
                with bounded_transaction(conn, run.schema):
                    write_outcomes(conn, run, self.remote_system, outcomes)
            granted = set()
        return granted


class _Returns:
    """What the workers handed back that the committing thread has not written yet."""

    def __init__(self, done: queue.SimpleQueue[Outcome | BaseException]) -> None:
        self._done = done
        self.outcomes: list[Outcome] = []
        self.lost = 0  # calls that ended in an unexpected error: no outcome, the key unknown
        self.failure: BaseException | None = None  # the first such error, raised at the end

    @property
    def ended(self) -> int:
        """The calls handed back: with an outcome, or without (an unexpected error)."""
        return len(self.outcomes) + self.lost

    def wait(self) -> None:
        """Wait for the next call to end; then take whatever else ended meanwhile."""
        self._take(self._done.get())
        self.poll()

    def poll(self) -> None:
        """Take whatever ended, without waiting."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._take(self._done.get_nowait())

    def take(self) -> list[Outcome]:
        """The outcomes to write now (the lost calls stay counted)."""
        outcomes, self.outcomes = self.outcomes, []
        return outcomes

    def _take(self, item: Outcome | BaseException) -> None:
        if isinstance(item, Outcome):
            self.outcomes.append(item)
        else:
            self.lost += 1
            self.failure = self.failure or item


class _Workers:
    """The calls to a remote that does not deduplicate, each worker calling the effects
    handed to it (their intents committed) one at a time on a connection of its own, and
    handing back each outcome.

    A blocking sender gets a thread per worker, each with an event loop of its own (its calls
    block only that worker; psycopg and sockets release the GIL while they wait, so the
    thread that commits goes on meanwhile). An async sender gets one event loop in a thread of
    its own, a coroutine per worker: its coroutines all run on one loop, as they would on the
    ledger's, and begin in the order the effects were handed out.
    """

    def __init__(
        self,
        remote_system: str,
        calls: Calls,
        sender: EffectSender[Any] | BlockingEffectSender[Any],
        size: int,
    ) -> None:
        self._remote_system = remote_system
        self._calls = calls
        self._blocking = isinstance(sender, BlockingEffectSender)
        self._sender = awaited(sender, in_threads=False)
        self.size = size
        self.window = size + INTENTS_AHEAD  # intents committed and not yet their outcomes, at most
        self.done: queue.SimpleQueue[Outcome | BaseException] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[Effect | None] = queue.SimpleQueue()  # blocking
        self._loop: asyncio.AbstractEventLoop | None = None  # async: the workers' loop
        self._loop_ready: asyncio.Queue[Effect | None] = asyncio.Queue()
        self._threads: list[threading.Thread] = []
        self._tasks: list[concurrent.futures.Future[None]] = []
        self._abandoned = False

    def start(self, count: int) -> None:
        """Have ``min(count, size)`` workers at least (each opens its connection on first need)."""
        if not self._blocking:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._spawn(self._host)
                self._tasks = [
                    asyncio.run_coroutine_threadsafe(self._serve(self._loop_ready.get), self._loop)
                    for _ in range(self.size)  # coroutines: idle ones open no connection
                ]
            return
        while len(self._threads) < min(count, self.size):
            self._spawn(lambda: asyncio.run(self._serve(self._next)))

    def hand(self, effect: Effect | None) -> None:
        """Give ``effect`` (its intent committed) to the next free worker; None ends one."""
        if self._loop is None:
            self._ready.put(effect)
        else:
            self._loop.call_soon_threadsafe(self._loop_ready.put_nowait, effect)

    def waiting(self) -> bool:
        """Whether effects handed out wait for a worker (so none idles)."""
        return not self._ready.empty() or self._loop_ready.qsize() > 0

    def close(self, *, abandon: bool) -> None:
        """End the workers once their calls in progress end, and close their connections;
        ``abandon``: the calls handed out and not begun are not made."""
        self._abandoned = abandon
        for _ in self._tasks or self._threads:
            self.hand(None)
        for task in self._tasks:
            task.result()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        for thread in self._threads:
            thread.join()
        self._threads, self._tasks, self._loop = [], [], None

    def _host(self) -> None:
        """The thread of an async sender's workers: their loop, closed as asyncio.run does."""
        loop = self._loop
        assert loop is not None
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def _spawn(self, target: Callable[[], Any]) -> None:
        name = f"ledger-{self._remote_system}-{len(self._threads)}"
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    async def _next(self) -> Effect | None:
        return self._ready.get()  # blocks this worker's own loop: it has nothing else to do

    async def _serve(self, take: Callable[[], Awaitable[Effect | None]]) -> None:
        pool = ConnectionPool(self._sender, 1)
        try:
            while (effect := await take()) is not None:
                self.done.put(await self._one(pool, effect))
        finally:
            await pool.aclose()

    async def _one(self, pool: ConnectionPool[Any], effect: Effect) -> Outcome | BaseException:
        if self._abandoned or self._calls.watch.lost:  # granted, but no call once it is lost
            return pending(effect.idempotency_key, NOT_SENT)
        try:
            crash_point("ledger.after_intent")
            return await self._calls.call(pool, self._sender, effect)
        except BaseException as exc:  # raised by the committing thread, after the others end
            return exc
