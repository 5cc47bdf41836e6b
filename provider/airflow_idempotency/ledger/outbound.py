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

A remote that does not deduplicate (``deduplicating`` false: SMTP, a chat webhook, a
notifier) gets step 2 as intent, call, outcome: a call begins only once a fenced
transaction has committed its key as ``unknown``, and the outcome replaces that after the
call. The calls are made by workers (one per connection, ``concurrency`` of them: threads
for a blocking sender) while this thread commits, one transaction at a time, the outcomes
that arrived together with the intents of the next calls, never more than
``concurrency + INTENTS_AHEAD`` (8) intents ahead of the outcomes committed. A crash in
between leaves the key ``unknown``: the claim returns it, and it is counted and reported,
never sent, until an operator resolves it (:mod:`airflow_idempotency.effects.resolutions`).
So a crash leaves at most ``concurrency + 8`` keys of an export unknown (12 for
:class:`~airflow_idempotency.effects.mail.SmtpSender`'s 4 connections): the calls in flight, the
calls granted and not begun, and the outcomes not yet written. Once the lock is lost no
intent commits and no further call begins; the outcomes received are still written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

import psycopg
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)
from tenacity.wait import wait_base

from airflow_idempotency import metrics
from airflow_idempotency._sql import query, query_rows
from airflow_idempotency._transactions import rollback_quietly
from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import (
    EffectsUnknownError,
    IdempotencyKeyConflictError,
    InvalidEffectError,
    InvalidInputError,
    LockLostError,
    OutcomeUnknownError,
    PermanentRemoteError,
    RemoteCallError,
    RemoteUnreachableError,
    TransientRemoteError,
)
from airflow_idempotency.ledger.senders import (
    BlockingEffectSender,
    Confirmation,
    ConnectionPool,
    Effect,
    EffectSender,
    HttpSender,
    Sender,
    _SenderContract,
    awaited,
)
from airflow_idempotency.metrics import Metrics
from airflow_idempotency.run_key import MAX_KEY_LENGTH, check_text

log = logging.getLogger(__name__)

# A remote that does not deduplicate: the intents committed beyond one per connection, at
# most, and so the unknown keys a crash leaves beyond concurrency. Fewer starve the calls
# while a commit (an fsync) is under way: with 8, email through the ledger keeps up with a
# plain smtplib loop (bench/emails.py: ~1.0x; 2 x concurrency there was ~0.85x).
INTENTS_AHEAD = 8

# Pipeline mode needs libpq >= 14 (the psycopg[binary] wheels bundle a newer one).
_PIPELINE = psycopg.Pipeline.is_supported()


class LedgerScope(Protocol):
    """What the ledger needs from the run it records effects for: a
    :class:`~airflow_idempotency.run_context.RunContext`, or a notification's scope outside
    a run (:mod:`airflow_idempotency.effects.notifications`)."""

    @property
    def job_name(self) -> str: ...

    @property
    def run_key(self) -> str: ...

    @property
    def attempt_id(self) -> int | None: ...

    @property
    def dry_run(self) -> bool: ...

    @property
    def schema(self) -> str: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def log(self) -> Any: ...

    def lock_is_held(self, conn: psycopg.Connection | None = None) -> bool: ...

    def fenced_transaction(self, conn: psycopg.Connection) -> AbstractContextManager[None]: ...

    def translate_error(self, exc: psycopg.Error, conn: psycopg.Connection) -> BaseException: ...

    def bookkeeping_connection(self) -> AbstractContextManager[psycopg.Connection]: ...


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
    unknown: int = 0  # not deduplicating: may have happened, not sent again (an operator decides)
    invalid: int = 0  # refused by the sender's check: neither recorded nor sent
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every effect is confirmed (sent now or before)."""
        return not (self.failed or self.pending or self.conflicts or self.unknown or self.invalid)

    def as_counts(self, prefix: str) -> dict[str, int]:
        """Counts for job_runs.details, e.g. ``exports_sent``."""
        return {
            f"{prefix}_sent": self.sent,
            f"{prefix}_skipped_existing": self.skipped_existing,
            f"{prefix}_failed": self.failed,
            f"{prefix}_pending": self.pending,
            f"{prefix}_conflicts": self.conflicts,
            f"{prefix}_unknown": self.unknown,
            f"{prefix}_invalid": self.invalid,
        }


@dataclass(frozen=True)
class Retries:
    """How the ledger tries a call again after a transient error (a timeout, a reset, 429,
    5xx, a 4xx SMTP reply): at most ``max_attempts`` tries in all per effect and call of
    :meth:`OutboundLedger.send_all`; between them it waits ``backoff_initial`` seconds
    doubling each time, plus up to 1 s of jitter, and never more than ``backoff_max``.

    ``OutboundLedger(run, "accounting", retries=Retries(max_attempts=3, backoff_max=2))``;
    ``Retries(max_attempts=1)`` never tries again (the next run does).
    """

    max_attempts: int = 5
    backoff_initial: float = 0.2
    backoff_max: float = 5.0

    def __post_init__(self) -> None:
        if not (isinstance(self.max_attempts, int) and self.max_attempts >= 1):
            raise InvalidInputError(
                f"Retries: max_attempts must be an integer >= 1, not {self.max_attempts!r}"
            )
        if not (self.backoff_initial >= 0 and self.backoff_max >= 0):
            raise InvalidInputError(
                "Retries: backoff_initial and backoff_max are seconds, >= 0, not "
                f"{self.backoff_initial!r} and {self.backoff_max!r}"
            )


@dataclass(frozen=True)
class _Batch:
    """A batch of effects ready to claim: checked keys and one fingerprint per effect."""

    effects: list[Effect]
    keys: list[str]
    fingerprints: list[str]
    position: dict[str, int]  # key -> index in the three lists
    invalid: list[str] = field(default_factory=list)  # "key: why", refused by the sender


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
    (connection refused or reset, timeouts), or once a whole batch of calls ended, retries
    spent, without one answer (a refused connection fails them all in well under the
    window); it stays down for the rest of the export.
    """

    def __init__(self, window: float) -> None:
        self.window = window
        self.silent_since: float | None = None  # monotonic
        self.silent_since_wall: dt.datetime | None = None
        self.last_error = ""
        self.down = False
        self.answers = 0
        self._lock = threading.Lock()  # the workers of a remote that does not deduplicate

    def answered(self) -> None:
        with self._lock:
            self.answers += 1
            if not self.down:
                self.silent_since = self.silent_since_wall = None

    def no_answer(self, error: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.last_error = error
            if self.silent_since is None:
                self.silent_since = now
                self.silent_since_wall = dt.datetime.now(dt.timezone.utc)
            elif now - self.silent_since >= self.window:
                self.down = True

    def batch_ended(self, answers_before: int) -> None:
        """A batch's calls are over: down if none had an answer and some had none."""
        with self._lock:
            if self.answers == answers_before and self.silent_since is not None:
                self.down = True


class OutboundLedger:
    """Send effects to ``remote_system`` at most once each, across reruns and crashes.

    Get one from a run: ``OutboundLedger(run, "accounting")``.

    :param concurrency: calls in flight at once (each on its own connection), unless the
        sender names its own.
    :param batch_size: effects claimed and recorded per statement.
    :param retries: how a call that failed with a transient error is tried again
        (:class:`Retries`: 5 tries, 0.2 s doubling up to 5 s between them).
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
        run: LedgerScope,
        remote_system: str,
        *,
        concurrency: int = 16,
        batch_size: int = 500,
        retries: Retries = Retries(),
        lock_check_interval: float = 0.5,
        unreachable_after: float = 10.0,
    ) -> None:
        check_text(remote_system, "remote system name")
        if concurrency < 1 or batch_size < 1:
            raise InvalidInputError("concurrency and batch_size must be >= 1")
        if not isinstance(retries, Retries):
            raise InvalidInputError(f"retries must be a Retries(...), not {retries!r}")
        self.run = run
        self.remote_system = remote_system
        self.concurrency = concurrency
        self.batch_size = batch_size
        self.retries = retries
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
        sender: EffectSender[Any] | BlockingEffectSender[Any] | Sender,
        *,
        base_url: str | None = None,
        timeout: float = 10.0,
        total: int | None = None,
        raise_on_failure: bool = True,
    ) -> LedgerSummary:
        """Send every effect not yet confirmed; return the counts.

        ``sender`` is an :class:`~airflow_idempotency.ledger.senders.EffectSender` or a
        :class:`~airflow_idempotency.ledger.senders.BlockingEffectSender` (SMTP, a webhook, a
        notifier, ...), or an HTTP call such as :func:`post_json`, sent to ``base_url``
        (a deduplicating remote) with ``timeout`` seconds per request. ``total``: how many
        effects the stream holds, for the progress messages.

        ``effects`` is consumed lazily, ``batch_size`` at a time. In a dry run nothing is
        sent and nothing written: the summary says what would be sent or skipped.
        After the whole stream was processed, raises
        :class:`IdempotencyKeyConflictError` when a key was reused for a different request,
        :class:`InvalidEffectError` when the sender refused effects (they were not sent, the
        others were), :class:`EffectsUnknownError` when effects of a remote that does not
        deduplicate are unknown (never resent on their own), and :class:`RemoteCallError`
        when an effect failed or stayed pending.
        """
        if not isinstance(sender, (EffectSender, BlockingEffectSender)):
            if base_url is None:
                raise InvalidInputError(
                    f"{self.remote_system}: an HTTP sender such as post_json(...) needs base_url="
                )
            sender = HttpSender(base_url, sender, timeout=timeout)
        summary = LedgerSummary()
        self._reach = _Reachability(self.unreachable_after)
        try:
            with self.run.bookkeeping_connection() as conn:
                self._conn = conn
                asyncio.run(self._send_all(conn, effects, sender, total, summary))
        finally:
            if not self.run.dry_run:
                self._count(summary)
        self._log_progress(summary, total, final=True)
        self._raise_for(summary, raise_on_failure)
        return summary

    def _raise_for(self, summary: LedgerSummary, raise_on_failure: bool) -> None:
        """The error :meth:`send_all` ends with, worst first (each names its effects)."""
        if summary.conflicts:
            raise IdempotencyKeyConflictError(
                f"{summary.conflicts} idempotency key(s) of {self.remote_system!r} were already "
                f"used for a different request, e.g. {_of(summary, 'request differs')}. Nothing "
                "was sent for them. A key must name one request forever: fix the data or use new "
                "keys on purpose (never for an effect that may already have happened)."
            )
        if summary.invalid:
            raise InvalidEffectError(
                f"{summary.invalid} effect(s) of {self.remote_system!r} refused, neither recorded "
                f"nor sent: {_of(summary, 'refused')}. The other effects were processed "
                f"({summary.sent} sent, {summary.skipped_existing} already confirmed). Fix the "
                "data and rerun: confirmed effects are not sent again."
            )
        if summary.unknown and raise_on_failure:
            raise EffectsUnknownError(
                f"{summary.unknown} effect(s) of {self.remote_system!r} are unknown: their call "
                "began and no outcome was recorded, so they may have happened; they are not "
                f"sent again on their own: {_of(summary, 'unknown')}. Look at the remote, then "
                f"`airflow-idempotency ledger mark-sent {self.remote_system} KEY --reason ...` "
                "or `... ledger resend ...`, and rerun the key."
            )
        if raise_on_failure and not summary.ok:
            raise RemoteCallError(
                f"{self.remote_system}: {summary.failed} effect(s) failed and {summary.pending} "
                f"stayed pending of {summary.total}; first errors: {summary.errors[:3]}. "
                "They are in the outbound ledger; a rerun retries them with the same keys."
            )

    def _count(self, summary: LedgerSummary) -> None:
        counts = {
            "sent": summary.sent,
            "skipped": summary.skipped_existing,
            "replayed": summary.replayed,
            "failed": summary.failed,
            "pending": summary.pending,
            "unknown": summary.unknown,
            "invalid": summary.invalid,
        }
        metrics.ledger_counts(self.run.metrics, counts, self.run.job_name, self.remote_system)

    def rows(self, job_name: str | None = None, run_key: str | None = None) -> list[dict[str, Any]]:
        """The ledger rows of a job's run key (default: this run's), ordered by key."""
        params = {
            "job_name": job_name or self.run.job_name,
            "run_key": run_key or self.run.run_key,
            "remote_system": self.remote_system,
        }
        with self.run.bookkeeping_connection() as conn:
            return query_rows(conn, "ledger_rows_for_run", self.run.schema, params)

    # -- internals ------------------------------------------------------------------------

    async def _send_all(
        self,
        conn: psycopg.Connection,
        effects: Iterable[Effect],
        sender: EffectSender[Any] | BlockingEffectSender[Any],
        total: int | None,
        summary: LedgerSummary,
    ) -> LedgerSummary:
        pool, workers = self._callers(sender)
        batches = (self._prepare(batch, sender) for batch in _batches(effects, self.batch_size))
        try:
            batch = next(batches, None)
            while batch is not None:
                # The next batch is pulled and prepared while the database runs this batch's
                # claim; an error in doing so is raised once this batch is done, as before.
                rows, upcoming = self._claim(conn, batch, sender, lambda: next(batches, None))
                to_send = self._classify(batch, rows, summary)
                if to_send and not self.run.dry_run:
                    await self._send_batch(conn, pool, workers, to_send, summary)
                    self._stop_if_cut_off(sender.target, summary, total)
                elif to_send:
                    summary.sent += len(to_send)  # would be sent
                self._log_progress(summary, total)
                if isinstance(upcoming, Exception):
                    raise upcoming
                batch = upcoming
        except BaseException:
            if workers is not None:  # no call begins any more; the calls in progress end
                workers.close(abandon=True)
                workers = None
            raise
        finally:
            await pool.aclose()
            if workers is not None:
                workers.close(abandon=False)
        return summary

    def _callers(
        self, sender: EffectSender[Any] | BlockingEffectSender[Any]
    ) -> tuple[ConnectionPool[Any], _Workers | None]:
        """Who makes the calls: the event loop over a pool of connections (deduplicating;
        a blocking sender's calls in as many executor threads), or the workers."""
        size = sender.concurrency or self.concurrency
        if sender.deduplicating and isinstance(sender, BlockingEffectSender):
            executor = concurrent.futures.ThreadPoolExecutor(
                size, thread_name_prefix=f"ledger-{self.remote_system}"
            )
            asyncio.get_running_loop().set_default_executor(executor)
        pool = ConnectionPool(awaited(sender, in_threads=True), size)
        return pool, None if sender.deduplicating else _Workers(self, sender, size)

    async def _send_batch(
        self,
        conn: psycopg.Connection,
        pool: ConnectionPool[Any],
        workers: _Workers | None,
        to_send: list[Effect],
        summary: LedgerSummary,
    ) -> None:
        """Make the calls of a claimed batch and record their outcomes."""
        answers_before = self._reach.answers
        if workers is None:
            outcomes = await asyncio.gather(
                *(self._call(pool, pool.sender, effect) for effect in to_send)
            )
            crash_point("ledger.before_record_outcomes")
            self._record(conn, outcomes, summary)
        else:
            workers.start(len(to_send))
            self._deliver(conn, workers, to_send, summary)
        self._reach.batch_ended(answers_before)

    def _stop_if_cut_off(self, target: str, summary: LedgerSummary, total: int | None) -> None:
        """After a batch's outcomes were written: stop once the lock is lost or the remote
        is down."""
        if self._lock_lost:
            raise LockLostError(
                f"job {self.run.job_name!r} run_key {self.run.run_key!r} lost its lock "
                f"during the export to {self.remote_system!r}: stopped sending; "
                "confirmations received so far are recorded."
            )
        if self._reach.down:
            self._log_progress(summary, total)
            raise self._unreachable(target, summary, total)

    def _prepare(
        self, effects: list[Effect], sender: EffectSender[Any] | BlockingEffectSender[Any]
    ) -> _Batch:
        """Check a batch's keys and effects; compute each request's fingerprint, once.

        A malformed key refuses the batch (as ever); an effect the sender refuses (no
        recipient, a path outside the root) is left out of it, named, and the rest goes on.
        """
        keys = [check_idempotency_key(effect.idempotency_key) for effect in effects]
        position = {key: i for i, key in enumerate(keys)}
        if len(position) != len(effects):
            raise InvalidInputError(
                f"duplicate idempotency keys in one batch of {self.remote_system!r}"
            )
        invalid = []
        if type(sender).check is not _SenderContract.check:
            kept = []
            for effect in effects:
                try:
                    sender.check(effect)
                except InvalidInputError as exc:
                    invalid.append(f"{effect.idempotency_key}: refused: {exc}")
                else:
                    kept.append(effect)
            if invalid:
                effects = kept
                keys = [effect.idempotency_key for effect in effects]
                position = {key: i for i, key in enumerate(keys)}
        return _Batch(effects, keys, [e.fingerprint for e in effects], position, invalid)

    def _claim(
        self,
        conn: psycopg.Connection,
        batch: _Batch,
        sender: EffectSender[Any] | BlockingEffectSender[Any],
        meanwhile: Callable[[], _Batch | None],
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
            "effect_kind": sender.kind,
            "deduplicating": sender.deduplicating,
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
            rollback_quietly(conn)
            raise self.run.translate_error(exc, conn) from exc
        crash_point("ledger.after_claim")
        return rows, upcoming

    def _classify(
        self, batch: _Batch, rows: list[tuple[Any, ...]], summary: LedgerSummary
    ) -> list[Effect]:
        """Count a claimed batch; return the effects to send (conflicts are never sent, nor
        are unknown effects: only an operator's resolution makes those pending again)."""
        summary.total += len(batch.effects) + len(batch.invalid)
        summary.invalid += len(batch.invalid)
        summary.errors.extend(batch.invalid)
        summary.skipped_existing += len(batch.effects) - len(rows)
        to_send = []
        for key, status, stored_fingerprint in rows:
            i = batch.position[key]
            if status is not None and stored_fingerprint != batch.fingerprints[i]:
                summary.conflicts += 1
                summary.errors.append(f"{key}: request differs from the one first sent")
            elif status == "succeeded":
                summary.skipped_existing += 1  # not returned by the statements; kept for safety
            elif status == "unknown":
                summary.unknown += 1
                summary.errors.append(f"{key}: unknown (a call began, no outcome recorded)")
            else:
                to_send.append(batch.effects[i])
        return to_send

    def _unreachable(
        self, target: str, summary: LedgerSummary, total: int | None
    ) -> RemoteUnreachableError:
        since = self._reach.silent_since_wall
        unclaimed = f" and {total - summary.total} not yet claimed" if total is not None else ""
        return RemoteUnreachableError(
            f"{self.remote_system} unreachable at {target} since "
            f"{since.isoformat(timespec='seconds') if since else 'now'} (no answer for "
            f"{self.unreachable_after:g} s; last error: {self._reach.last_error}); "
            f"{summary.pending} effect(s) left pending{unclaimed}, {summary.sent} sent: a rerun "
            "resends them with the same keys."
        )

    async def _send(
        self, connection: Any, sender: EffectSender[Any], effect: Effect
    ) -> Confirmation:
        """One try of one call, noting whether the remote answered at all."""
        try:
            confirmation = await sender.send(connection, effect)
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

    async def _call(
        self, pool: ConnectionPool[Any], sender: EffectSender[Any], effect: Effect
    ) -> _Outcome:
        """One effect: its first try, then retries of transient errors.

        A deduplicating remote is called only while the lock is held (checked at most every
        ``lock_check_interval``). For one that does not deduplicate, the intent recorded
        just before (fenced) is the check, and an :class:`OutcomeUnknownError` ends the call
        at once: the effect is unknown and is not tried again.
        """
        key = effect.idempotency_key
        fenced_here = sender.deduplicating
        crash_point("ledger.before_remote_call")
        if fenced_here and not self._lock_still_held():
            return _Outcome(key, "pending", None, _NOT_SENT, 0)
        if self._reach.down:
            return _Outcome(key, "pending", None, _UNREACHABLE, 0)
        try:
            # Most calls succeed at once: only a transient error pays for the retry loop.
            async with pool.connection() as connection:
                confirmation = await self._send(connection, sender, effect)
        except OutcomeUnknownError as exc:
            if not sender.deduplicating:
                return _Outcome(key, "unknown", None, f"outcome unknown: {exc}", 1)
            return await self._retry(pool, sender, effect, exc)
        except TransientRemoteError as exc:
            return await self._retry(pool, sender, effect, exc)
        except PermanentRemoteError as exc:
            return _Outcome(key, "failed", None, str(exc), 1)
        crash_point("ledger.after_remote_commit")
        return _Outcome(key, "succeeded", confirmation.reference, None, 1, confirmation.replayed)

    async def _retry(
        self,
        pool: ConnectionPool[Any],
        sender: EffectSender[Any],
        effect: Effect,
        first_error: TransientRemoteError,
    ) -> _Outcome:
        """Tries 2..max_attempts of a call whose first try failed with a transient error.

        The retry loop's attempt 1 re-raises that first error instead of calling again, so
        the attempt count, the waits and the final error are exactly those of one loop
        around every try. For a remote that does not deduplicate, only errors that say the
        effect was not delivered are retried (under the same intent).
        """
        key = effect.idempotency_key
        calls = 1
        dedup = sender.deduplicating

        def retryable(exc: BaseException) -> bool:
            return isinstance(exc, TransientRemoteError) and (
                dedup or not isinstance(exc, OutcomeUnknownError)
            )

        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(retryable),
                stop=stop_after_attempt(self.retries.max_attempts),
                wait=_backoff(self.retries.backoff_initial, self.retries.backoff_max),
                reraise=True,
            ):
                with attempt:
                    if attempt.retry_state.attempt_number == 1:
                        raise first_error
                    if dedup and not self._lock_still_held():
                        return _Outcome(key, "pending", None, _NOT_SENT, calls)
                    if self._reach.down:
                        return _Outcome(key, "pending", None, _UNREACHABLE, calls)
                    calls += 1
                    async with pool.connection() as connection:
                        confirmation = await self._send(connection, sender, effect)
        except OutcomeUnknownError as exc:
            if not dedup:
                return _Outcome(key, "unknown", None, f"outcome unknown: {exc}", calls)
            return _Outcome(key, "pending", None, f"gave up after {calls} tries: {exc}", calls)
        except TransientRemoteError as exc:
            return _Outcome(key, "pending", None, f"gave up after {calls} tries: {exc}", calls)
        except PermanentRemoteError as exc:
            return _Outcome(key, "failed", None, str(exc), calls)
        crash_point("ledger.after_remote_commit")
        return _Outcome(
            key, "succeeded", confirmation.reference, None, calls, confirmation.replayed
        )

    # -- a remote that does not deduplicate: intent, call, outcome --------------------------

    def _deliver(
        self,
        conn: psycopg.Connection,
        workers: _Workers,
        effects: list[Effect],
        summary: LedgerSummary,
    ) -> None:
        """Send a claimed batch through the workers, each call only after its intent committed.

        This thread commits, in one transaction each time, the outcomes that arrived and the
        intents of the next calls, never more than ``workers.window`` intents ahead of the
        outcomes committed: at any moment at most that many keys of the export are
        ``unknown`` without their outcome (the crash bound of the module doc). The workers go
        on with the calls already granted while it commits. The outcomes of the batch's last
        calls are written together, once every call has ended.
        """
        todo = deque(effects)
        back = _Returns(workers.done)
        local: list[_Outcome] = []  # effects not called (lock lost, remote down): pending
        outstanding = 0  # intents committed whose outcome is not (yet)
        while True:
            if not todo or back.failure is not None or self._lock_lost or self._reach.down:
                if todo and back.failure is None:  # not called: pending, saying why
                    reason = _NOT_SENT if self._lock_lost else _UNREACHABLE
                    local.extend(
                        _Outcome(e.idempotency_key, "pending", None, reason, 0) for e in todo
                    )
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
            if back.failure is not None or self._reach.down:
                continue
            room = workers.window - outstanding + len(back.outcomes)
            calls = [todo.popleft() for _ in range(min(room, len(todo)))]
            outstanding -= len(back.outcomes)
            granted, local = self._grant(conn, workers, back.take() + local, calls, summary)
            outstanding += granted
        crash_point("ledger.before_record_outcomes")
        if back.outcomes or local:
            self._grant(conn, workers, back.take() + local, [], summary)
        if back.failure is not None:
            raise back.failure

    def _grant(
        self,
        conn: psycopg.Connection,
        workers: _Workers,
        outcomes: list[_Outcome],
        calls: list[Effect],
        summary: LedgerSummary,
    ) -> tuple[int, list[_Outcome]]:
        """Write ``outcomes`` and the intents of ``calls`` in one transaction, and hand the
        calls granted to the workers; return how many, and the outcomes of the calls refused
        because the lock was lost."""
        granted = self._write_intents(conn, outcomes, [e.idempotency_key for e in calls])
        self._tally(outcomes, summary)
        refused = []
        for effect in calls:
            if effect.idempotency_key in granted:
                workers.hand(effect)
            elif self._lock_lost:
                refused.append(_Outcome(effect.idempotency_key, "pending", None, _NOT_SENT, 0))
            else:  # another attempt or an operator moved it meanwhile
                summary.skipped_existing += 1
        return len(granted), refused

    def _write_intents(
        self,
        conn: psycopg.Connection,
        outcomes: list[_Outcome],
        keys: list[str],
    ) -> set[str]:
        """Record ``outcomes`` and the intents of ``keys`` in one transaction (fenced when
        there are intents); return the keys that may be called now.

        A lost lock refuses the intents, not the outcomes: those are facts about the remote
        and are written alone then.
        """
        granted: set[str] = set()
        fenced = bool(keys) and not self._lock_lost
        pipeline = conn.pipeline() if _PIPELINE else contextlib.nullcontext()
        try:
            with pipeline:
                with self.run.fenced_transaction(conn) if fenced else conn.transaction():
                    if outcomes:
                        conn.execute(
                            query("ledger_record_outcomes", self.run.schema),
                            self._outcome_params(outcomes),
                        )
                    if fenced:  # no intent commits without the lock
                        cursor = conn.execute(
                            query("ledger_record_intents", self.run.schema),
                            {
                                "keys": keys,
                                "remote_system": self.remote_system,
                                "attempt_id": self.run.attempt_id,
                            },
                        )
                if fenced:
                    granted = {key for (key,) in cursor.fetchall()}
        except psycopg.Error as exc:
            lost = self.run.translate_error(exc, conn)
            if not isinstance(lost, LockLostError):
                raise lost from exc
            rollback_quietly(conn)
            self._lock_lost = True
            if outcomes:
                with conn.transaction():
                    conn.execute(
                        query("ledger_record_outcomes", self.run.schema),
                        self._outcome_params(outcomes),
                    )
            granted = set()
        return granted

    # -- recording outcomes -------------------------------------------------------------

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

    def _outcome_params(self, outcomes: list[_Outcome]) -> dict[str, Any]:
        return {
            "keys": [o.key for o in outcomes],
            "statuses": [o.status for o in outcomes],
            "references": [o.reference for o in outcomes],
            "errors": [o.error for o in outcomes],
            "calls": [o.calls for o in outcomes],
            "remote_system": self.remote_system,
            "attempt_id": self.run.attempt_id,
        }

    def _record(
        self, conn: psycopg.Connection, outcomes: list[_Outcome], summary: LedgerSummary
    ) -> None:
        conn.execute(
            query("ledger_record_outcomes", self.run.schema), self._outcome_params(outcomes)
        )
        self._tally(outcomes, summary)

    @staticmethod
    def _tally(outcomes: list[_Outcome], summary: LedgerSummary) -> None:
        for outcome in outcomes:
            summary.calls += outcome.calls
            if outcome.status == "succeeded":
                summary.sent += 1
                summary.replayed += outcome.replayed
            elif outcome.status == "failed":
                summary.failed += 1
                summary.errors.append(f"{outcome.key}: {outcome.error}")
            elif outcome.status == "unknown":
                summary.unknown += 1
                summary.errors.append(f"{outcome.key}: unknown: {outcome.error}")
            else:
                summary.pending += 1
                summary.errors.append(f"{outcome.key}: {outcome.error}")

    def _log_progress(self, summary: LedgerSummary, total: int | None, final: bool = False) -> None:
        of = f" of {total}" if total is not None else ""
        verb = "would send" if self.run.dry_run else "sent"
        self.run.log.info(
            "%s %s: %s %d, skipped %d (already confirmed), failed %d, pending %d, conflicts %d, "
            "unknown %d, invalid %d; %d processed%s",
            "export finished" if final else "export progress",
            self.remote_system,
            verb,
            summary.sent,
            summary.skipped_existing,
            summary.failed,
            summary.pending,
            summary.conflicts,
            summary.unknown,
            summary.invalid,
            summary.total,
            of,
        )


def _of(summary: LedgerSummary, marker: str, limit: int = 3) -> list[str]:
    """The first ``limit`` errors of ``summary`` that mention ``marker``."""
    return [e for e in summary.errors if marker in e][:limit]


class _Returns:
    """What the workers handed back that the committing thread has not written yet."""

    def __init__(self, done: queue.SimpleQueue[_Outcome | BaseException]) -> None:
        self._done = done
        self.outcomes: list[_Outcome] = []
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

    def take(self) -> list[_Outcome]:
        """The outcomes to write now (the lost calls stay counted)."""
        outcomes, self.outcomes = self.outcomes, []
        return outcomes

    def _take(self, item: _Outcome | BaseException) -> None:
        if isinstance(item, _Outcome):
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
        ledger: OutboundLedger,
        sender: EffectSender[Any] | BlockingEffectSender[Any],
        size: int,
    ) -> None:
        self._ledger = ledger
        self._blocking = isinstance(sender, BlockingEffectSender)
        self._sender = awaited(sender, in_threads=False)
        self.size = size
        self.window = size + INTENTS_AHEAD  # intents committed and not yet their outcomes, at most
        self.done: queue.SimpleQueue[_Outcome | BaseException] = queue.SimpleQueue()
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
        name = f"ledger-{self._ledger.remote_system}-{len(self._threads)}"
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

    async def _one(self, pool: ConnectionPool[Any], effect: Effect) -> _Outcome | BaseException:
        if self._abandoned or self._ledger._lock_lost:  # granted, but no call once it is lost
            return _Outcome(effect.idempotency_key, "pending", None, _NOT_SENT, 0)
        try:
            crash_point("ledger.after_intent")
            return await self._ledger._call(pool, self._sender, effect)
        except BaseException as exc:  # raised by the committing thread, after the others end
            return exc
