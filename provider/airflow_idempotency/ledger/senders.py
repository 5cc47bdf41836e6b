"""What an external effect is, and how it reaches its remote: the sender interface.

An :class:`Effect` is a stable idempotency key and the request it stands for. An
:class:`EffectSender` delivers effects of one kind to one remote, and says which contract
the outbound ledger must keep for it (``deduplicating``):

- **deduplicating**: the remote honours the key (an HTTP API with ``Idempotency-Key``, a
  webhook that deduplicates, an atomic file replace). On doubt (a timeout, a crash) the
  ledger sends the effect again with the same key and the remote acts once: *exactly once,
  with the remote's help*;
- **not deduplicating**: the remote cannot tell a resend (SMTP, a chat webhook, a notifier).
  The ledger records the intent before each call and the outcome after it; a crash or a
  lost answer in between leaves the effect ``unknown``, which is never sent again on its own
  until an operator resolves it (mark it sent, or resend it): *at most once*.

A sender is an :class:`EffectSender` (coroutines: ``async def connect/send``, e.g. the
HTTP senders on httpx) or a :class:`BlockingEffectSender` (plain methods, e.g. SMTP on
smtplib, an Airflow notifier). A sender that does not deduplicate is called by the ledger's
workers, one per connection (``concurrency``), while the ledger commits the intents of the
next calls: a thread per worker for a blocking sender, one event loop of their own (in a
thread) for an async one. A deduplicating sender is called on the ledger's event loop (a
blocking one in ``concurrency`` threads).

A sender classifies each call by what it raises: nothing (a :class:`Confirmation`),
:class:`~airflow_idempotency.exceptions.TransientRemoteError` (not delivered; try again),
:class:`~airflow_idempotency.exceptions.OutcomeUnknownError` (it may have been delivered),
:class:`~airflow_idempotency.exceptions.PermanentRemoteError` (refused). ``check`` refuses a
malformed effect before anything is written for it.

The HTTP senders are in :mod:`airflow_idempotency.ledger.http`; email, notifiers and output
files in :mod:`airflow_idempotency.effects`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from airflow_idempotency.exceptions import (
    TransientRemoteError,
)

# The canonical JSON of a request: exactly json.dumps(request, sort_keys=True,
# separators=(",", ":"), default=str), without building a new encoder for every call.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class Effect:
    """One external side effect: a stable idempotency key and the JSON request it sends."""

    idempotency_key: str
    request: Mapping[str, Any]

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of the request (computed on each access)."""
        return hashlib.sha256(_CANONICAL_JSON.encode(self.request).encode()).hexdigest()


@dataclass(frozen=True)
class Confirmation:
    """The remote's confirmation of an effect."""

    reference: str
    response: Mapping[str, Any] | None = None
    replayed: bool = False  # the remote answered with the result it had stored for the key


ConnectionT = TypeVar("ConnectionT")


class _SenderContract(ABC, Generic[ConnectionT]):
    """What the ledger reads of any sender: its kind, its contract, its connections' count,
    where it sends, and the check of an effect."""

    kind: str = "custom"
    deduplicating: bool = False
    concurrency: int | None = None
    target: str = ""

    def check(self, effect: Effect) -> None:
        """Refuse a malformed effect with :class:`InvalidInputError` naming it (no recipient,
        an invalid address, ...). A refused effect is neither recorded nor sent; the others
        are; the ledger raises at the end, naming each."""


class EffectSender(_SenderContract[ConnectionT]):
    """Delivers effects of one kind to one remote, over connections the ledger pools.

    Subclasses set :attr:`kind` and :attr:`deduplicating` (the contract, see the module
    doc), and implement :meth:`connect` and :meth:`send` (coroutines; for plain blocking
    functions, subclass :class:`BlockingEffectSender`).

    :ivar kind: what the effects are, as the ledger, the CLI and the Run keys view show it
        (``http``, ``email``, ``notification``, ``webhook``, ``file``, or your own word).
    :ivar deduplicating: the remote honours the idempotency key, so a resend on doubt is
        safe. ``False`` is the safe default: at most once.
    :ivar concurrency: calls in flight at once (one connection each); ``None``: the ledger's.
    :ivar target: where the effects go, for messages (a URL, ``smtp://host:port``).
    """

    @abstractmethod
    async def connect(self) -> ConnectionT:
        """Open one connection to the remote (lent to one call at a time)."""

    async def disconnect(self, connection: ConnectionT) -> None:
        """Close a connection :meth:`connect` opened (nothing by default)."""

    @abstractmethod
    async def send(self, connection: ConnectionT, effect: Effect) -> Confirmation:
        """Deliver one effect, or raise the error that classifies what happened."""

    async def discard(self, connection: ConnectionT) -> None:
        """Drop a connection after an error that may have left it unusable (closes it)."""
        with contextlib.suppress(Exception):
            await self.disconnect(connection)


class BlockingEffectSender(_SenderContract[ConnectionT]):
    """An :class:`EffectSender` of plain blocking functions (smtplib, a notifier, a client
    library without asyncio): the same attributes and contract; ``connect``, ``send``,
    ``disconnect`` and ``discard`` are ordinary methods.

    Each connection is used by one thread at a time: the ledger's worker thread that opened
    it (a sender that does not deduplicate), or, for a deduplicating one, whichever of the
    ledger's ``concurrency`` executor threads runs the call.
    """

    @abstractmethod
    def connect(self) -> ConnectionT:
        """Open one connection to the remote (lent to one call at a time)."""

    def disconnect(self, connection: ConnectionT) -> None:
        """Close a connection :meth:`connect` opened (nothing by default)."""

    @abstractmethod
    def send(self, connection: ConnectionT, effect: Effect) -> Confirmation:
        """Deliver one effect, or raise the error that classifies what happened."""

    def discard(self, connection: ConnectionT) -> None:
        """Drop a connection after an error that may have left it unusable (closes it)."""
        with contextlib.suppress(Exception):
            self.disconnect(connection)


class _Awaited(EffectSender[ConnectionT]):
    """A :class:`BlockingEffectSender` as an :class:`EffectSender`: each method runs in a
    thread of the event loop's default executor (``in_threads``: on the ledger's loop), or
    right away, blocking the event loop it is called on (a worker thread's own)."""

    def __init__(self, sender: BlockingEffectSender[ConnectionT], *, in_threads: bool) -> None:
        self.sender = sender
        self.kind = sender.kind
        self.deduplicating = sender.deduplicating
        self.concurrency = sender.concurrency
        self.target = sender.target
        self.in_threads = in_threads

    def check(self, effect: Effect) -> None:
        self.sender.check(effect)

    async def _run(self, call: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(call, *args) if self.in_threads else call(*args)

    async def connect(self) -> ConnectionT:
        connection: ConnectionT = await self._run(self.sender.connect)
        return connection

    async def disconnect(self, connection: ConnectionT) -> None:
        await self._run(self.sender.disconnect, connection)

    async def send(self, connection: ConnectionT, effect: Effect) -> Confirmation:
        confirmation: Confirmation = await self._run(self.sender.send, connection, effect)
        return confirmation

    async def discard(self, connection: ConnectionT) -> None:
        await self._run(self.sender.discard, connection)


def awaited(
    sender: EffectSender[ConnectionT] | BlockingEffectSender[ConnectionT], *, in_threads: bool
) -> EffectSender[ConnectionT]:
    """``sender`` as an :class:`EffectSender` (a blocking one wrapped, see :class:`_Awaited`)."""
    if isinstance(sender, BlockingEffectSender):
        return _Awaited(sender, in_threads=in_threads)
    return sender


class ConnectionPool(Generic[ConnectionT]):
    """Up to ``size`` connections of one sender, each lent to one call at a time.

    Connections are opened on first need (an export whose effects are all confirmed opens
    none) and reused most-recently-returned first. A call that ends in an error other than
    a confirmation or a refusal returns its connection broken: it is closed, and the next
    call opens a new one.
    """

    def __init__(self, sender: EffectSender[ConnectionT], size: int) -> None:
        self._sender = sender
        self._slots = asyncio.Semaphore(size)
        self._idle: list[ConnectionT] = []

    @property
    def sender(self) -> EffectSender[ConnectionT]:
        return self._sender

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[ConnectionT]:
        async with self._slots:
            connection = self._idle.pop() if self._idle else await self._sender.connect()
            try:
                yield connection
            except (TransientRemoteError, OSError, asyncio.TimeoutError):
                await self._sender.discard(connection)
                raise
            except BaseException:
                self._idle.append(connection)
                raise
            self._idle.append(connection)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            with contextlib.suppress(Exception):
                await self._sender.disconnect(connection)
