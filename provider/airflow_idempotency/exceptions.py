"""The exceptions this provider raises: one base class, a shallow hierarchy."""

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


class IdempotencyKeyConflictError(InvalidInputError):
    """An idempotency key was reused with a different request."""


class SchemaError(IdempotencyError):
    """The bookkeeping schema is missing, newer than this code, or could not be migrated."""


class RunLockedError(IdempotencyError):
    """Another execution holds the lock of this (job, run key)."""

    def __init__(self, message: str, *, holder: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}


class LockLostError(IdempotencyError):
    """The lock session ended while the run was in progress: this attempt may not finish."""


class RemoteCallError(IdempotencyError):
    """One or more external side effects failed permanently (see the outbound ledger)."""
