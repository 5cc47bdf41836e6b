"""``OutboundLedger``: a stream of effects sent batch by batch, none confirmed sent again.

Each effect has a stable idempotency key (``finalize_invoices:2026-10-01:order_12345``)
and a request. :meth:`OutboundLedger.send_all` processes a stream of effects in batches:

1. one statement records the batch's new keys as ``pending`` (existing rows untouched)
   and returns what the ledger already knows: keys ``succeeded`` for the same request are
   skipped without a call (the statement leaves them out of its result); a key stored with
   a different request fingerprint is refused (like Stripe's ``idempotency_error``);
   ``pending`` and ``failed`` keys are sent again with the SAME key. The next batch is
   pulled from the stream while the database runs this statement
   (:mod:`~airflow_idempotency.ledger.claim`);
2. the calls go out concurrently (bounded), each carrying its key; transient errors
   (timeouts, connection resets, 409/429/5xx) are retried with exponential backoff
   (:mod:`~airflow_idempotency.ledger.calls`, :mod:`~airflow_idempotency.ledger.retries`);
3. one statement records the batch's outcomes: ``succeeded`` with the remote reference,
   ``failed`` with the reason for a permanent refusal, ``pending`` when retries ran out.

The claim of each batch is fenced: it commits only while this run still holds its lock
(:meth:`~airflow_idempotency.run_context.RunContext.fenced_transaction`).
A crash anywhere leaves ``pending`` rows, which the rerun sends again under the same key,
so the remote (which deduplicates by key) acts once
(:mod:`~airflow_idempotency.ledger.deduplicating`).

A remote that does not deduplicate (``deduplicating`` false: SMTP, a chat webhook, a
notifier) gets step 2 as intent, call, outcome: a call begins only once a fenced
transaction has committed its key as ``unknown``, and the outcome replaces that after the
call (:mod:`~airflow_idempotency.ledger.pipeline`, which says what a crash leaves).
:meth:`~OutboundLedger.send_all` picks one of the two ways once, from its sender.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import psycopg

from airflow_idempotency import metrics
from airflow_idempotency._sql import query_rows
from airflow_idempotency.exceptions import (
    EffectsUnknownError,
    IdempotencyKeyConflictError,
    InvalidEffectError,
    InvalidInputError,
    LockLostError,
    RemoteCallError,
    RemoteUnreachableError,
)
from airflow_idempotency.ledger.calls import Calls
from airflow_idempotency.ledger.claim import batches, claim, classify, prepare
from airflow_idempotency.ledger.deduplicating import DeduplicatingBatches
from airflow_idempotency.ledger.http import HttpSender, Sender
from airflow_idempotency.ledger.outcomes import LedgerSummary
from airflow_idempotency.ledger.pipeline import Pipeline
from airflow_idempotency.ledger.reachability import Reachability
from airflow_idempotency.ledger.retries import Retries
from airflow_idempotency.ledger.scope import LedgerScope, LockWatch
from airflow_idempotency.ledger.senders import BlockingEffectSender, Effect, EffectSender
from airflow_idempotency.run_key import check_text


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
        self._reach = Reachability(unreachable_after)
        # Once lost, the lock stays lost for this ledger's later calls of send_all too.
        self._watch = LockWatch(run, lock_check_interval)

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
        self._reach = Reachability(self.unreachable_after)
        try:
            with self.run.bookkeeping_connection() as conn:
                self._watch.conn = conn
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
        """Claim the stream batch by batch, and send each claimed batch the one way its
        sender's remote needs: all at once (deduplicating), or intent, call, outcome."""
        calls = Calls(self.retries, self._watch, self._reach)
        way = DeduplicatingBatches if sender.deduplicating else Pipeline
        size = sender.concurrency or self.concurrency
        path = way(self.run, self.remote_system, calls, sender, size)
        claimed = (
            prepare(batch, sender, self.remote_system)
            for batch in batches(effects, self.batch_size)
        )
        abandon = True
        try:
            batch = next(claimed, None)
            while batch is not None:
                # The next batch is pulled and prepared while the database runs this batch's
                # claim; an error in doing so is raised once this batch is done, as before.
                rows, upcoming = claim(
                    self.run, self.remote_system, conn, batch, sender, lambda: next(claimed, None)
                )
                to_send = classify(batch, rows, summary)
                if to_send and not self.run.dry_run:
                    answers_before = self._reach.answers
                    await path.send(conn, to_send, summary)
                    self._reach.batch_ended(answers_before)
                    self._stop_if_cut_off(sender.target, summary, total)
                elif to_send:
                    summary.sent += len(to_send)  # would be sent
                self._log_progress(summary, total)
                if isinstance(upcoming, Exception):
                    raise upcoming
                batch = upcoming
            abandon = False
        finally:  # on an error no call begins any more; the calls in progress end
            await path.close(abandon=abandon)
        return summary

    def _stop_if_cut_off(self, target: str, summary: LedgerSummary, total: int | None) -> None:
        """After a batch's outcomes were written: stop once the lock is lost or the remote
        is down."""
        if self._watch.lost:
            raise LockLostError(
                f"job {self.run.job_name!r} run_key {self.run.run_key!r} lost its lock "
                f"during the export to {self.remote_system!r}: stopped sending; "
                "confirmations received so far are recorded."
            )
        if self._reach.down:
            self._log_progress(summary, total)
            raise self._unreachable(target, summary, total)

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
