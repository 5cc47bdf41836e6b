"""Whether a remote still answers at all, from the outcomes of the calls in flight."""

from __future__ import annotations

import datetime as dt
import threading
import time


class Reachability:
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
