"""The exceptions this provider raises: one base class, a shallow hierarchy.

What each means for a task (mapped to Airflow's failures in one place,
:func:`airflow_idempotency.operator.airflow_failure`):

- :class:`InvalidInputError` and :class:`ConfigurationError`: nothing was done and a
  retry cannot help, so the task fails without retrying;
- :class:`RunLockedError`: another execution holds the key; the operator's ``on_locked``
  policy decides (reschedule, fail or skip);
- :class:`LockLostError`, :class:`WorkConflictError`, :class:`PoolExhaustedError`,
  :class:`LockWaitError` and :class:`RemoteCallError`: this try could not finish; a retry
  (or a rerun) converges, so Airflow's retries apply;
- :class:`MigrationBlockedError` and :class:`SchemaTooNewError`: nothing was done, and a
  retry succeeds once the blocking session has ended or this worker runs the newer release
  (a rolling upgrade), so Airflow's retries apply;
- :class:`TransientRemoteError`, :class:`OutcomeUnknownError` and
  :class:`PermanentRemoteError`: raised by a ledger sender to classify one external call;
  the ledger handles them;
- :class:`EffectsUnknownError`: effects of a remote that does not deduplicate may have
  happened and were not sent again: an operator resolves them, a retry cannot, so the task
  fails without retrying;
- :class:`InvalidEffectError`: some effects were malformed (no recipient, a path outside the
  allowed root): they were not sent, the others were; fix the data and rerun;
- :class:`NotificationError`: raised by a ``notify_once`` callback after its other
  notifiers went, naming each that failed (Airflow logs it; the task's state stays).
"""

from __future__ import annotations

from typing import Any


class IdempotencyError(Exception):
    """Base class of every error raised by airflow_idempotency."""


class InvalidInputError(IdempotencyError, ValueError):
    """Input was refused before anything was written: retrying will not help."""


class InvalidRunKeyError(InvalidInputError):
    """A run key is malformed, missing, or names a period that has not ended yet."""


class RunKeyMissingError(InvalidRunKeyError):
    """A manual run has neither a logical date nor an explicit ``run_key``."""


class PeriodNotEndedError(InvalidRunKeyError):
    """The run key names a business period that has not ended yet."""


class RunKeyConflictError(InvalidRunKeyError):
    """An explicit ``run_key`` contradicts the run's ``partition_key``."""


class IdempotencyKeyConflictError(InvalidInputError):
    """An idempotency key was reused with a different request."""


class OutputConflictError(IdempotencyKeyConflictError):
    """An output file was committed before with other content; only a forced run replaces it."""


class ConfigurationError(IdempotencyError):
    """The deployment cannot give the guarantees as configured: fix it, a retry will not."""


class SchemaError(ConfigurationError):
    """The bookkeeping schema does not match this release's migrations: fix it, a retry will not."""


class MigrationMismatchError(SchemaError):
    """An applied migration differs from this release's file of that number (another name, or
    the file was edited after it was applied): the database and this build disagree."""


class SchemaTooNewError(IdempotencyError):
    """The bookkeeping schema was migrated by a newer release: this worker runs nothing on it.

    ``version`` is the database's, ``expected`` this release's. Retryable: in a rolling
    upgrade a retry runs on (or after) an upgraded worker.
    """

    def __init__(self, message: str, *, version: int, expected: int) -> None:
        super().__init__(message)
        self.version = version
        self.expected = expected


class MigrationBlockedError(IdempotencyError):
    """A migration gave up waiting for a lock another session held; nothing was changed.

    ``blockers`` describes the sessions that held the locks (pid, role, application_name,
    state, transaction and query start), as named in the message.
    """

    def __init__(self, message: str, *, blockers: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.blockers = blockers or []


class MissingPrivilegeError(ConfigurationError):
    """The job database's role may not create, migrate or use the bookkeeping tables.

    Its message names both ways out: grant the role what it needs, or have a DBA run
    ``airflow-idempotency migrate`` (:func:`airflow_idempotency.schema.privilege_refusal`).
    """


class SharedSessionError(ConfigurationError):
    """The lock connection's server session is shared with other clients."""


class SchemaNotReadyError(ConfigurationError):
    """A reader found the bookkeeping schema missing or older than this code (it never migrates).

    ``version`` is the applied version (0: no tables), ``expected`` the one this code reads.
    """

    def __init__(self, message: str, *, version: int, expected: int) -> None:
        super().__init__(message)
        self.version = version
        self.expected = expected


class RunLockedError(IdempotencyError):
    """Another execution holds the lock of this (job, run key)."""

    def __init__(self, message: str, *, holder: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}


class LockLostError(IdempotencyError):
    """The lock session ended while the run was in progress: this attempt may not finish."""


class PoolExhaustedError(IdempotencyError):
    """A connection pooler had no server connection for the run in time: size its pool up."""


class ConnectionWaitError(IdempotencyError):
    """No connection to the job database could be had within ``connect_timeout``: a pooler at
    its ``max_client_conn`` or with a full listen backlog, a server at its limit, or the
    network. The message names the sizing rule (docs/deploying.md, pool sizing); a retry
    converges once connections are free."""


class LockWaitError(IdempotencyError):
    """A lock wait of the provider's own statements reached its bound (the message names what
    it waited for): nothing of that transaction was written; a retry converges."""


class TransactionMisuseError(InvalidInputError):
    """The work ended or prepared (two-phase commit) a fenced transaction itself."""


class WorkConflictError(IdempotencyError):
    """The work's transaction lost a serialization conflict or a deadlock and was rolled back."""


class RemoteCallError(IdempotencyError):
    """One or more external side effects failed or stayed pending (see the outbound ledger)."""


class RemoteUnreachableError(RemoteCallError):
    """The remote system stopped answering: the batch stopped early, the rest left pending."""


class RemoteError(IdempotencyError):
    """Base class of the errors a ledger sender raises to classify one external call."""


class TransientRemoteError(RemoteError):
    """The call may have failed for a passing reason: retry it with the same key.

    ``unreachable``: no answer came at all (connection refused or reset, a timeout), as
    opposed to an answer saying "later" (a 503); the ledger stops a batch early when every
    call has been unreachable for a while.
    """

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class OutcomeUnknownError(TransientRemoteError):
    """The call may have reached the remote and acted on it (e.g. the connection dropped after
    an email's data was sent, before the server's answer).

    A remote that deduplicates gets it again with the same key (as any transient error). For
    one that does not, the ledger leaves the effect ``unknown`` and never sends it on its own.
    """


class PermanentRemoteError(RemoteError):
    """The remote refused the request: retrying the same request will not help."""


class EffectsUnknownError(RemoteCallError):
    """Effects of a remote that does not deduplicate are ``unknown``: they may have happened.

    They are never sent again on their own. An operator looks at the remote and resolves
    each: ``airflow-idempotency ledger mark-sent`` or ``ledger resend``; then a rerun goes on.
    """


class InvalidEffectError(InvalidInputError):
    """Some effects were malformed and not sent (each named); the others were processed."""


class NotificationError(IdempotencyError):
    """Some notifications of a callback failed or are unknown (each named); the others went."""
