"""The run the ledger records effects for, and its watch on the run's lock.

What the ledger needs of the run (:class:`LedgerScope`), and its watch on the run's lock
(:class:`LockWatch`).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any, Protocol

import psycopg

from airflow_idempotency.metrics import Metrics


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


class LockWatch:
    """Whether the run still holds its lock, as the ledger last saw it: lost for good once
    a check says so, or a fenced transaction was refused (:attr:`lost`).

    :param interval: re-check at most this often (:meth:`held`), on ``conn``.
    """

    def __init__(self, run: LedgerScope, interval: float) -> None:
        self.run = run
        self.interval = interval
        self.conn: psycopg.Connection | None = None  # the export's bookkeeping connection
        self.lost = False
        self._checked_at = 0.0

    def held(self) -> bool:
        """Re-check the lock at most every ``interval`` seconds (~0.2 ms a check).

        Runs on the event loop's thread between awaits, so the connection is never used by
        two coroutines at once.
        """
        if self.lost:
            return False
        now = time.monotonic()
        if now - self._checked_at >= self.interval:
            assert self.conn is not None
            self.lost = not self.run.lock_is_held(self.conn)
            self._checked_at = now
        return not self.lost
