"""The outbound ledger: external side effects that a rerun never repeats.

Each effect has a stable idempotency key (``finalize_invoices:2026-10-01:order_12345``)
and a request. :meth:`OutboundLedger.send_all` processes a stream of effects in batches:

1. one statement records the batch's new keys as ``pending`` (existing rows untouched)
   and returns what the ledger already knows: keys ``succeeded`` for the same request are
   skipped without a call (the statement leaves them out of its result); a key stored with
   a different request fingerprint is refused (like Stripe's ``idempotency_error``);
   ``pending`` and ``failed`` keys are sent again with the SAME key. The next batch is
   pulled from the stream while the database runs this statement;
2. the calls go out concurrently (bounded), each carrying its key; transient errors
   (timeouts, connection resets, 409/429/5xx) are retried with exponential backoff;
3. one statement records the batch's outcomes: ``succeeded`` with the remote reference,
   ``failed`` with the reason for a permanent refusal, ``pending`` when retries ran out.

The claim of each batch is fenced: it commits only while this run still holds its lock
(:meth:`~airflow_idempotency.run_context.RunContext.fenced_transaction`).
A crash anywhere leaves ``pending`` rows, which the rerun sends again under the same key,
so the remote (which deduplicates by key) acts once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any

import httpx
import psycopg
from psycopg.rows import dict_row
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)
from tenacity.wait import wait_base

from airflow_idempotency import metrics
from airflow_idempotency._sql import query
from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import (
    IdempotencyKeyConflictError,
    InvalidInputError,
    LockLostError,
    PermanentRemoteError,
    RemoteCallError,
    RemoteUnreachableError,
    TransientRemoteError,
)
from airflow_idempotency.run_key import MAX_KEY_LENGTH, check_text

if TYPE_CHECKING:
    from airflow_idempotency.run_context import RunContext

log = logging.getLogger(__name__)

# The canonical JSON of a request: exactly json.dumps(request, sort_keys=True,
# separators=(",", ":"), default=str), without building a new encoder for every call.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str)
# Pipeline mode needs libpq >= 14 (the psycopg[binary] wheels bundle a newer one).
_PIPELINE = psycopg.Pipeline.is_supported()


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


Sender = Callable[[httpx.AsyncClient, Effect], Awaitable[Confirmation]]


def post_json(path: str, *, reference_field: str = "reference") -> Sender:
    """A sender that POSTs the request as JSON with an ``Idempotency-Key`` header.

    2xx confirms (``reference_field`` of the JSON answer is the remote reference; an
    ``Idempotent-Replayed: true`` header, as Stripe and the example service send, marks
    a replay of an earlier answer);
    408, 409 (the same key is in flight), 425, 429 and 5xx are transient; any other 4xx
    is permanent. Timeouts and connection errors are transient.
    """

    async def send(client: httpx.AsyncClient, effect: Effect) -> Confirmation:
        try:
            response = await client.post(
                path, json=effect.request, headers={"Idempotency-Key": effect.idempotency_key}
            )
        except httpx.TransportError as exc:  # timeouts, resets, refused connections
            raise TransientRemoteError(f"{type(exc).__name__}: {exc}", unreachable=True) from exc
        status = response.status_code
        if 200 <= status < 300:
            body = response.json()
            replayed = response.headers.get("Idempotent-Replayed", "").lower() == "true"
            return Confirmation(str(body[reference_field]), body, replayed)
        detail = f"HTTP {status}: {response.text[:300]}"
        if status in (408, 409, 425, 429) or status >= 500:
            raise TransientRemoteError(detail)
        raise PermanentRemoteError(detail)

    return send


@dataclass
class LedgerSummary:
    """Counts of one :meth:`OutboundLedger.send_all` call."""

    total: int = 0
    sent: int = 0
    skipped_existing: int = 0
    failed: int = 0
    pending: int = 0
    conflicts: int = 0
    calls: int = 0
    replayed: int = 0  # of ``sent``: the remote replayed its answer (it had the key)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every effect is confirmed (sent now or before)."""
        return self.failed == 0 and self.pending == 0 and self.conflicts == 0

    def as_counts(self, prefix: str) -> dict[str, int]:
        """Counts for job_runs.details, e.g. ``exports_sent``."""
        return {
            f"{prefix}_sent": self.sent,
            f"{prefix}_skipped_existing": self.skipped_existing,
            f"{prefix}_failed": self.failed,
            f"{prefix}_pending": self.pending,
            f"{prefix}_conflicts": self.conflicts,
        }


@dataclass(frozen=True)
class _Batch:
    """A batch of effects ready to claim: checked keys and one fingerprint per effect."""

    effects: list[Effect]
    keys: list[str]
    fingerprints: list[str]
    position: dict[str, int]  # key -> index in the three lists


def _attempt(call: Callable[[], _Batch | None]) -> _Batch | Exception | None:
    """What ``call`` returns, or the exception it raised (for the caller to raise later)."""
    try:
        return call()
    except Exception as exc:
        return exc


@dataclass(frozen=True)
class _Outcome:
    key: str
    status: str  # succeeded | failed | pending
    reference: str | None
    error: str | None
    calls: int
    replayed: bool = False


class _ClientPool:
    """Up to ``size`` HTTP clients of one connection each, each lent to one call at a time.

    One ``httpx.AsyncClient`` with N connections costs O(N) per request: its pool
    (httpcore 1.0) checks every connection it holds, polling each idle socket, whenever a
    request starts or ends. At 32 concurrent calls that made a shared client ~3x slower
    than 32 clients of one connection each (see BENCHMARKS.md). Here the bound on
    concurrent calls is the number of clients, so each request sees a pool of one.

    Clients are created on first need (an export whose effects are all confirmed opens
    none) and share one SSL context: building a context loads the CA bundle, ~10-120 ms.
    """

    def __init__(self, base_url: str, timeout: float, size: int) -> None:
        self._base_url = base_url
        self._timeout = timeout
        self._slots = asyncio.Semaphore(size)
        self._idle: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []
        self._ssl_context: Any = None

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[httpx.AsyncClient]:
        """Wait for a free slot and lend its client (the most recently returned one)."""
        async with self._slots:
            client = self._idle.pop() if self._idle else self._new_client()
            try:
                yield client
            finally:
                self._idle.append(client)

    def _new_client(self) -> httpx.AsyncClient:
        if self._ssl_context is None:
            self._ssl_context = httpx.create_ssl_context()  # what each client would build
        client = httpx.AsyncClient(
            base_url=self._base_url,
            timeout=self._timeout,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            verify=self._ssl_context,
        )
        self._all.append(client)
        return client

    async def aclose(self) -> None:
        for client in self._all:
            await client.aclose()
        self._all.clear()
        self._idle.clear()


def _backoff(initial: float, maximum: float) -> wait_base:
    """Exponential backoff with jitter: ``initial`` seconds times 2**n, capped at ``maximum``."""
    try:  # newer tenacity (9.2.1 here) calls the factor `multiplier`, deprecating `initial`
        return wait_exponential_jitter(multiplier=initial, max=maximum)
    except TypeError:  # older tenacity (the provider accepts >= 8.2) knows only `initial`
        return wait_exponential_jitter(initial=initial, max=maximum)


def _plain_ascii_key(key: object) -> bool:
    """Whether ``key`` is a valid idempotency key of the common kind, checked cheaply.

    True only for text that :func:`check_idempotency_key` accepts: printable ASCII
    (in ASCII the control characters are exactly the unprintable ones, and no ASCII code
    point is a surrogate or unassigned), 1..MAX_KEY_LENGTH long, without surrounding
    blanks. False says nothing: the full check decides (and words the refusal).
    """
    return (
        type(key) is str
        and key.isascii()
        and key.isprintable()
        and 0 < len(key) <= MAX_KEY_LENGTH
        and key == key.strip()
    )


def check_idempotency_key(key: object) -> str:
    """Refuse a key that cannot travel as an HTTP header value: printable ASCII only."""
    if _plain_ascii_key(key):  # ~0.3 µs instead of ~5-25 µs of unicodedata per character
        assert isinstance(key, str)
        return key
    check_text(key, "idempotency key")
    assert isinstance(key, str)
    if not key.isascii():
        raise InvalidInputError(
            f"idempotency key {key!r} is not ASCII: it is sent as an HTTP header "
            "(Idempotency-Key), so use ASCII letters, digits and punctuation, e.g. "
            "'finalize_invoices:2026-10-01:order_12345'"
        )
    return key


def _batches(effects: Iterable[Effect], size: int) -> Iterator[list[Effect]]:
    iterator = iter(effects)
    while batch := list(islice(iterator, size)):
        yield batch


_NOT_SENT = "not sent: this run lost its lock (another attempt may own the key now)"
_UNREACHABLE = "not sent: the remote stopped answering; a rerun sends it with the same key"


class _Reachability:
    """Whether the remote still answers at all, from the outcomes of the calls in flight.

    Any answer (a confirmation, a refusal, even a 503) proves it reachable. It is down once
    no call has had an answer for ``window`` seconds while calls kept failing without one
    (connection refused or reset, timeouts), and it stays down for the rest of the export.
    """

    def __init__(self, window: float) -> None:
        self.window = window
        self.silent_since: float | None = None  # monotonic
        self.silent_since_wall: dt.datetime | None = None
        self.last_error = ""
        self.down = False

    def answered(self) -> None:
        if not self.down:
            self.silent_since = self.silent_since_wall = None

    def no_answer(self, error: str) -> None:
        now = time.monotonic()
        self.last_error = error
        if self.silent_since is None:
            self.silent_since = now
            self.silent_since_wall = dt.datetime.now(dt.timezone.utc)
        elif now - self.silent_since >= self.window:
            self.down = True


class OutboundLedger:
    """Send effects to ``remote_system`` at most once each, across reruns and crashes.

    Get one from a run: ``OutboundLedger(run, "accounting")``.

    :param concurrency: calls in flight at once (each on its own one-connection HTTP client).
    :param batch_size: effects claimed and recorded per statement.
    :param max_attempts: tries per effect and call of :meth:`send_all` (transient errors).
    :param timeout: seconds per HTTP request.
    :param lock_check_interval: before a call, re-check (at most this often) that the run
        still holds its lock; once it is lost no further call is made.
    :param unreachable_after: stop the export early when no call has had any answer for
        this many seconds (connection refused or reset, timeouts on every call in flight):
        the rest stays pending with the same keys and the try fails at once with
        :class:`~airflow_idempotency.exceptions.RemoteUnreachableError`, instead of every
        pending effect retrying on its own for minutes.
    """

    def __init__(
        self,
        run: RunContext,
        remote_system: str,
        *,
        concurrency: int = 16,
        batch_size: int = 500,
        max_attempts: int = 5,
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        timeout: float = 10.0,
        lock_check_interval: float = 0.5,
        unreachable_after: float = 10.0,
    ) -> None:
        check_text(remote_system, "remote system name")
        if concurrency < 1 or batch_size < 1 or max_attempts < 1:
            raise InvalidInputError("concurrency, batch_size and max_attempts must be >= 1")
        self.run = run
        self.remote_system = remote_system
        self.concurrency = concurrency
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.timeout = timeout
        self.lock_check_interval = lock_check_interval
        self.unreachable_after = unreachable_after
        self._reach = _Reachability(unreachable_after)
        self._conn: psycopg.Connection | None = None
        self._lock_checked_at = 0.0
        self._lock_lost = False

    # -- public API -----------------------------------------------------------------------

    def send_all(
        self,
        effects: Iterable[Effect],
        sender: Sender,
        *,
        base_url: str,
        total: int | None = None,
        raise_on_failure: bool = True,
    ) -> LedgerSummary:
        """Send every effect not yet confirmed; return the counts.

        ``effects`` is consumed lazily, ``batch_size`` at a time. In a dry run nothing is
        sent and nothing written: the summary says what would be sent or skipped.
        Raises :class:`RemoteCallError` at the end when an effect failed or stayed pending
        (after the whole stream was processed), and :class:`IdempotencyKeyConflictError`
        when a key was reused for a different request.
        """
        summary = LedgerSummary()
        self._reach = _Reachability(self.unreachable_after)
        try:
            with self.run.bookkeeping_connection() as conn:
                self._conn = conn
                asyncio.run(self._send_all(conn, effects, sender, base_url, total, summary))
        finally:
            if not self.run.dry_run:
                self._count(summary)
        self._log_progress(summary, total, final=True)
        if summary.conflicts:
            raise IdempotencyKeyConflictError(
                f"{summary.conflicts} idempotency key(s) of {self.remote_system!r} were already "
                f"used for a different request, e.g. {summary.errors[:3]}. Nothing was sent for "
                "them. A key must name one request forever: fix the data or use new keys on "
                "purpose (never for an effect that may already have happened)."
            )
        if raise_on_failure and not summary.ok:
            raise RemoteCallError(
                f"{self.remote_system}: {summary.failed} effect(s) failed and {summary.pending} "
                f"stayed pending of {summary.total}; first errors: {summary.errors[:3]}. "
                "They are in the outbound ledger; a rerun retries them with the same keys."
            )
        return summary

    def _count(self, summary: LedgerSummary) -> None:
        counts = {
            "sent": summary.sent,
            "skipped": summary.skipped_existing,
            "replayed": summary.replayed,
            "failed": summary.failed,
            "pending": summary.pending,
        }
        metrics.ledger_counts(self.run.metrics, counts, self.run.job_name, self.remote_system)

    def rows(self, job_name: str | None = None, run_key: str | None = None) -> list[dict[str, Any]]:
        """The ledger rows of a job's run key (default: this run's), ordered by key."""
        params = {
            "job_name": job_name or self.run.job_name,
            "run_key": run_key or self.run.run_key,
            "remote_system": self.remote_system,
        }
        with self.run.bookkeeping_connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            return list(cur.execute(query("ledger_rows_for_run", self.run.schema), params))

    # -- internals ------------------------------------------------------------------------

    async def _send_all(
        self,
        conn: psycopg.Connection,
        effects: Iterable[Effect],
        sender: Sender,
        base_url: str,
        total: int | None,
        summary: LedgerSummary,
    ) -> LedgerSummary:
        clients = _ClientPool(base_url, self.timeout, self.concurrency)
        batches = (self._prepare(batch) for batch in _batches(effects, self.batch_size))
        try:
            batch = next(batches, None)
            while batch is not None:
                # The next batch is pulled and prepared while the database runs this batch's
                # claim; an error in doing so is raised once this batch is done, as before.
                rows, upcoming = self._claim(conn, batch, lambda: next(batches, None))
                to_send = self._classify(batch, rows, summary)
                if to_send and not self.run.dry_run:
                    outcomes = await asyncio.gather(
                        *(self._call(clients, sender, effect) for effect in to_send)
                    )
                    crash_point("ledger.before_record_outcomes")
                    self._record(conn, outcomes, summary)
                    if self._lock_lost:
                        raise LockLostError(
                            f"job {self.run.job_name!r} run_key {self.run.run_key!r} lost its lock "
                            f"during the export to {self.remote_system!r}: stopped sending; "
                            "confirmations received so far are recorded."
                        )
                    if self._reach.down:
                        self._log_progress(summary, total)
                        raise self._unreachable(base_url, summary, total)
                elif to_send:
                    summary.sent += len(to_send)  # would be sent
                self._log_progress(summary, total)
                if isinstance(upcoming, Exception):
                    raise upcoming
                batch = upcoming
        finally:
            await clients.aclose()
        return summary

    def _prepare(self, effects: list[Effect]) -> _Batch:
        """Check a batch's keys and compute each request's fingerprint, once."""
        keys = [check_idempotency_key(effect.idempotency_key) for effect in effects]
        position = {key: i for i, key in enumerate(keys)}
        if len(position) != len(effects):
            raise InvalidInputError(
                f"duplicate idempotency keys in one batch of {self.remote_system!r}"
            )
        return _Batch(effects, keys, [effect.fingerprint for effect in effects], position)

    def _claim(
        self, conn: psycopg.Connection, batch: _Batch, meanwhile: Callable[[], _Batch | None]
    ) -> tuple[list[tuple[Any, ...]], _Batch | Exception | None]:
        """Claim a batch (fenced); call ``meanwhile`` while the database runs the statement.

        Returns the rows of the keys that need something (both statements leave out the
        keys confirmed for this very request) and what ``meanwhile`` returned or raised.

        In pipeline mode a statement is sent at once and its result read later, so the
        claim runs on the server while ``meanwhile`` runs here. The claim is a fenced
        transaction (:meth:`RunContext.fenced_transaction`): its first statement checks the
        lock and holds the key's fence, and its COMMIT fails if the lock was lost meanwhile
        (the claim is then rolled back). The transaction stays open while ``meanwhile`` runs
        (pulling the next batch: normally a few ms).
        """
        params = {
            "keys": batch.keys,
            "fingerprints": batch.fingerprints,
            "remote_system": self.remote_system,
            "job_name": self.run.job_name,
            "run_key": self.run.run_key,
            "attempt_id": self.run.attempt_id,
        }
        pipeline = conn.pipeline() if _PIPELINE else contextlib.nullcontext()
        if self.run.dry_run:
            with pipeline:
                cursor = conn.execute(query("ledger_classify_batch", self.run.schema), params)
                upcoming = _attempt(meanwhile)
                return cursor.fetchall(), upcoming
        try:
            with pipeline:
                with self.run.fenced_transaction(conn):  # no claim commits once the lock is gone
                    cursor = conn.execute(query("ledger_claim_batch", self.run.schema), params)
                    upcoming = _attempt(meanwhile)
                rows = cursor.fetchall()
        except psycopg.Error as exc:
            raise self.run.translate_error(exc, conn) from exc
        crash_point("ledger.after_claim")
        return rows, upcoming

    def _classify(
        self, batch: _Batch, rows: list[tuple[Any, ...]], summary: LedgerSummary
    ) -> list[Effect]:
        """Count a claimed batch; return the effects to send (conflicts are never sent)."""
        summary.total += len(batch.effects)
        summary.skipped_existing += len(batch.effects) - len(rows)
        to_send = []
        for key, status, stored_fingerprint in rows:
            i = batch.position[key]
            if status is not None and stored_fingerprint != batch.fingerprints[i]:
                summary.conflicts += 1
                summary.errors.append(f"{key}: request differs from the one first sent")
            elif status == "succeeded":
                summary.skipped_existing += 1  # not returned by the statements; kept for safety
            else:
                to_send.append(batch.effects[i])
        return to_send

    def _unreachable(
        self, base_url: str, summary: LedgerSummary, total: int | None
    ) -> RemoteUnreachableError:
        since = self._reach.silent_since_wall
        unclaimed = f" and {total - summary.total} not yet claimed" if total is not None else ""
        return RemoteUnreachableError(
            f"{self.remote_system} unreachable at {base_url} since "
            f"{since.isoformat(timespec='seconds') if since else 'now'} (no answer for "
            f"{self.unreachable_after:g} s; last error: {self._reach.last_error}); "
            f"{summary.pending} effect(s) left pending{unclaimed}, {summary.sent} sent: a rerun "
            "resends them with the same keys."
        )

    async def _send(
        self, client: httpx.AsyncClient, sender: Sender, effect: Effect
    ) -> Confirmation:
        """One try of one call, noting whether the remote answered at all."""
        try:
            confirmation = await sender(client, effect)
        except TransientRemoteError as exc:
            if exc.unreachable:
                self._reach.no_answer(str(exc))
            else:
                self._reach.answered()
            raise
        except PermanentRemoteError:
            self._reach.answered()
            raise
        self._reach.answered()
        return confirmation

    async def _call(self, clients: _ClientPool, sender: Sender, effect: Effect) -> _Outcome:
        key = effect.idempotency_key
        async with clients.client() as client:
            crash_point("ledger.before_remote_call")
            if not self._lock_still_held():
                return _Outcome(key, "pending", None, _NOT_SENT, 0)
            if self._reach.down:
                return _Outcome(key, "pending", None, _UNREACHABLE, 0)
            try:
                # Most calls succeed at once: only a transient error pays for the retry loop.
                confirmation = await self._send(client, sender, effect)
            except TransientRemoteError as exc:
                return await self._retry(client, sender, effect, exc)
            except PermanentRemoteError as exc:
                return _Outcome(key, "failed", None, str(exc), 1)
            crash_point("ledger.after_remote_commit")
            return _Outcome(
                key, "succeeded", confirmation.reference, None, 1, confirmation.replayed
            )

    async def _retry(
        self,
        client: httpx.AsyncClient,
        sender: Sender,
        effect: Effect,
        first_error: TransientRemoteError,
    ) -> _Outcome:
        """Tries 2..max_attempts of a call whose first try failed with a transient error.

        The retry loop's attempt 1 re-raises that first error instead of calling again, so
        the attempt count, the waits and the final error are exactly those of one loop
        around every try.
        """
        calls = 1
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(TransientRemoteError),
                stop=stop_after_attempt(self.max_attempts),
                wait=_backoff(self.backoff_initial, self.backoff_max),
                reraise=True,
            ):
                with attempt:
                    if attempt.retry_state.attempt_number == 1:
                        raise first_error
                    if not self._lock_still_held():
                        return _Outcome(effect.idempotency_key, "pending", None, _NOT_SENT, calls)
                    if self._reach.down:
                        return _Outcome(
                            effect.idempotency_key, "pending", None, _UNREACHABLE, calls
                        )
                    calls += 1
                    confirmation = await self._send(client, sender, effect)
        except TransientRemoteError as exc:
            return _Outcome(
                effect.idempotency_key,
                "pending",
                None,
                f"gave up after {calls} tries: {exc}",
                calls,
            )
        except PermanentRemoteError as exc:
            return _Outcome(effect.idempotency_key, "failed", None, str(exc), calls)
        crash_point("ledger.after_remote_commit")
        return _Outcome(
            effect.idempotency_key,
            "succeeded",
            confirmation.reference,
            None,
            calls,
            confirmation.replayed,
        )

    def _lock_still_held(self) -> bool:
        """Re-check the lock at most every ``lock_check_interval`` seconds (~0.2 ms a check).

        Runs on the event loop's thread between awaits, so the connection is never used by
        two coroutines at once.
        """
        if self._lock_lost:
            return False
        now = time.monotonic()
        if now - self._lock_checked_at >= self.lock_check_interval:
            assert self._conn is not None
            self._lock_lost = not self.run.lock_is_held(self._conn)
            self._lock_checked_at = now
        return not self._lock_lost

    def _record(
        self, conn: psycopg.Connection, outcomes: list[_Outcome], summary: LedgerSummary
    ) -> None:
        conn.execute(
            query("ledger_record_outcomes", self.run.schema),
            {
                "keys": [o.key for o in outcomes],
                "statuses": [o.status for o in outcomes],
                "references": [o.reference for o in outcomes],
                "errors": [o.error for o in outcomes],
                "calls": [o.calls for o in outcomes],
                "remote_system": self.remote_system,
                "attempt_id": self.run.attempt_id,
            },
        )
        for outcome in outcomes:
            summary.calls += outcome.calls
            if outcome.status == "succeeded":
                summary.sent += 1
                summary.replayed += outcome.replayed
            elif outcome.status == "failed":
                summary.failed += 1
                summary.errors.append(f"{outcome.key}: {outcome.error}")
            else:
                summary.pending += 1
                summary.errors.append(f"{outcome.key}: {outcome.error}")

    def _log_progress(self, summary: LedgerSummary, total: int | None, final: bool = False) -> None:
        of = f" of {total}" if total is not None else ""
        verb = "would send" if self.run.dry_run else "sent"
        self.run.log.info(
            "%s %s: %s %d, skipped %d (already confirmed), failed %d, pending %d, conflicts %d; "
            "%d processed%s",
            "export finished" if final else "export progress",
            self.remote_system,
            verb,
            summary.sent,
            summary.skipped_existing,
            summary.failed,
            summary.pending,
            summary.conflicts,
            summary.total,
            of,
        )
