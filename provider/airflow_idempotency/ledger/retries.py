"""How the ledger tries a call again after a transient error: settings and the retry loop.

:class:`Retries` holds the user's settings, :func:`retry` is the loop around tries 2..n of one
call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)
from tenacity.wait import wait_base

from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import (
    InvalidInputError,
    OutcomeUnknownError,
    PermanentRemoteError,
    TransientRemoteError,
)
from airflow_idempotency.ledger.outcomes import Outcome, pending
from airflow_idempotency.ledger.senders import Confirmation


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


def _backoff(initial: float, maximum: float) -> wait_base:
    """Exponential backoff with jitter: ``initial`` seconds times 2**n, capped at ``maximum``."""
    try:  # newer tenacity (9.2.1 here) calls the factor `multiplier`, deprecating `initial`
        return wait_exponential_jitter(multiplier=initial, max=maximum)
    except TypeError:  # older tenacity (the provider accepts >= 8.2) knows only `initial`
        return wait_exponential_jitter(initial=initial, max=maximum)


async def retry(
    retries: Retries,
    key: str,
    first_error: TransientRemoteError,
    again: Callable[[], Awaitable[Confirmation | str]],
    *,
    deduplicating: bool,
) -> Outcome:
    """Tries 2..max_attempts of the call of ``key``, whose first try failed with a transient
    error: each try is ``again()``, which returns the confirmation, or the reason it was not
    made (the lock lost, the remote down: the effect then stays pending, saying why).

    The retry loop's attempt 1 re-raises that first error instead of calling again, so
    the attempt count, the waits and the final error are exactly those of one loop
    around every try. For a remote that does not deduplicate, only errors that say the
    effect was not delivered are retried (under the same intent).
    """
    calls = 1

    def retryable(exc: BaseException) -> bool:
        return isinstance(exc, TransientRemoteError) and (
            deduplicating or not isinstance(exc, OutcomeUnknownError)
        )

    try:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(retryable),
            stop=stop_after_attempt(retries.max_attempts),
            wait=_backoff(retries.backoff_initial, retries.backoff_max),
            reraise=True,
        ):
            with attempt:
                if attempt.retry_state.attempt_number == 1:
                    raise first_error
                calls += 1  # before the call: a try that raises counts
                answer = await again()
                if isinstance(answer, str):  # not made
                    return pending(key, answer, calls - 1)
                confirmation = answer
    except OutcomeUnknownError as exc:
        if not deduplicating:
            return Outcome(key, "unknown", None, f"outcome unknown: {exc}", calls)
        return pending(key, f"gave up after {calls} tries: {exc}", calls)
    except TransientRemoteError as exc:
        return pending(key, f"gave up after {calls} tries: {exc}", calls)
    except PermanentRemoteError as exc:
        return Outcome(key, "failed", None, str(exc), calls)
    crash_point("ledger.after_remote_commit")
    return Outcome(key, "succeeded", confirmation.reference, None, calls, confirmation.replayed)
