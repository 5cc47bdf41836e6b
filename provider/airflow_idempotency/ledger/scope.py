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

    def lock_session_ended(self) -> bool: ...

    def fenced_transaction(self, conn: psycopg.Connection) -> AbstractContextManager[None]: ...

    def translate_error(self, exc: psycopg.Error, conn: psycopg.Connection) -> BaseException: ...

    def bookkeeping_connection(self) -> AbstractContextManager[psycopg.Connection]: ...


class LockWatch:
    """Whether the run still holds its lock, as the ledger last saw it: lost for good once
    a check says so, or a fenced transaction was refused (:attr:`lost`).

    Two checks, before every call: a look at the lock session's socket, which sees a session
    the server ended (terminated, restarted) at once and costs no round trip (~3 us,
    :func:`~airflow_idempotency.locks.session_ended`); and the database's own check, at most
    every ``interval`` seconds, on ``conn``, which also sees a lock lost without a word (a cut
    link the server has given up on).
    """

    def __init__(self, run: LedgerScope, interval: float) -> None:
        self.run = run
        self.interval = interval
        self.conn: psycopg.Connection | None = None  # the export's bookkeeping connection
        self.lost = False
        self._checked_at = 0.0

    def held(self) -> bool:
        """Both checks (the database's at most every ``interval`` seconds, ~0.2 ms).

        Runs on the thread that owns ``conn`` (the ledger's event loop, between awaits), so
        the connection is never used by two callers at once.
        """
        if self.ended():
            return False
        now = time.monotonic()
        if now - self._checked_at >= self.interval:
            assert self.conn is not None
            try:
                self.lost = not self.run.lock_is_held(self.conn)
            except psycopg.Error:  # the ledger's own session failed: no call until known
                self.lost = True  # (the outcomes' write then says what happened)
            self._checked_at = now
        return not self.lost

    def ended(self) -> bool:
        """The cheap check alone, from any thread: lost, or the lock session visibly ended."""
        if not self.lost and self.run.lock_session_ended():
            self.lost = True
        return self.lost
