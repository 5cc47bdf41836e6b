"""A process-wide watch of steps that may last too long, from one daemon thread.

One thread for every run of the process, not a timer thread per run (issue 32, goal 4). The
runner warns with it when a start waits long (run_steps); the lease mode starts a lease's
heartbeat thread with it when the first renewal is due (leases.LeaseHeartbeat).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class SlowStepWatch:
    """Calls a step's warning once the step has lasted ``seconds`` (the start's wait, run_steps),
    for every run of the process from one daemon thread: a ``threading.Timer`` per step would
    start a thread per run, about 0.1 ms of the run's CPU (issue 32, goal 4).

    The thread never sleeps longer than ``seconds``, so a step registered while it sleeps is
    due no earlier than its next wake: nothing has to wake it. It ends once nothing is
    watched, and the next step starts another.
    """

    def __init__(self, seconds: float, name: str = "airflow-idempotency-watch") -> None:
        self.seconds = seconds
        self.name = name  # its thread's
        self._cond = threading.Condition()
        self._due: dict[object, tuple[float, Callable[[], None]]] = {}
        self._thread: threading.Thread | None = None

    def reset(self) -> None:
        """Forget the parent's thread and lock in a forked child."""
        self._cond = threading.Condition()
        self._due = {}
        self._thread = None

    @contextlib.contextmanager
    def watching(self, warn: Callable[[], None]) -> Iterator[None]:
        """The block is the step: ``warn()`` runs (in the watch's thread) if it lasts longer.
        When the watch's thread cannot be started (a thread limit), the step runs unwatched:
        a warning is no reason to fail it."""
        try:
            token: object | None = self.add(warn)
        except RuntimeError:
            token = None
        try:
            yield
        finally:
            if token is not None:
                self.remove(token)

    def add(self, warn: Callable[[], None]) -> object:
        """Watch a step that begins now: ``warn()`` runs (in the watch's thread) once it has
        lasted ``seconds``, unless :meth:`remove` was called with the token returned first.
        (``warn`` may still run as ``remove`` is called: it must allow for that.) When the
        watch's thread cannot be started, the error is raised, nothing is watched for it, and
        the next call tries again."""
        token = object()
        with self._cond:
            self._due[token] = (time.monotonic() + self.seconds, warn)
            if self._thread is None:
                thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                try:
                    thread.start()
                except BaseException:  # no thread now (a thread limit): the next add tries
                    del self._due[token]
                    raise
                self._thread = thread
        return token

    def remove(self, token: object) -> None:
        """The step of ``token`` (from :meth:`add`) has ended."""
        with self._cond:
            self._due.pop(token, None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._due:
                    self._thread = None
                    return
                now = time.monotonic()
                fired = [token for token, (due, _) in self._due.items() if due <= now]
                warnings = [self._due.pop(token)[1] for token in fired]
                nearest = min((due for due, _ in self._due.values()), default=now + self.seconds)
            for warn in warnings:
                with contextlib.suppress(Exception):  # a warning never stops the watch
                    warn()
            with self._cond:
                self._cond.wait(max(0.0, min(nearest - time.monotonic(), self.seconds)))
