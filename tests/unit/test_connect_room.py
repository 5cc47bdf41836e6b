"""connect_when_room's words when a refused connection spent the whole bound on its first try
(adv33a): the refusal was raised without a line, neither "waiting" nor "giving up", though the
docstring promises the last refusal is said before it is raised. No database: ``connect``
refuses as a server restarting does."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import psycopg
import pytest

from airflow_idempotency.run_context import connect_when_room


def test_a_refusal_that_spent_the_bound_on_its_first_try_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tries = [0]

    @contextlib.contextmanager
    def connect() -> Iterator[psycopg.Connection]:
        tries[0] += 1
        time.sleep(0.3)  # a connect_timeout longer than what is left of the caller's bound
        raise psycopg.OperationalError("connection failed: Connection refused")
        yield  # pragma: no cover

    log = logging.getLogger("adv33a.connect_room")
    waited: list[float] = []
    with caplog.at_level(logging.WARNING, logger=log.name):
        room = connect_when_room(connect, "the outbound ledger", log, waited.append, within=0.2)
        with pytest.raises(psycopg.OperationalError), room():
            pass
    said = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert tries == [1]
    assert any("giving up" in line and "the outbound ledger" in line for line in said), said


class TaskTimeout(BaseException):
    """Stands for Airflow's AirflowTaskTimeout (a BaseException raised by a signal)."""


def test_a_wait_ended_by_the_tasks_timeout_does_not_say_the_bound_was_spent(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task's timeout raised during a pause between tries ends the wait: it is raised as it
    is, and the log does not say the database "still refused" until the bound (the operator
    would lengthen the lock wait for nothing)."""
    tries = [0]

    @contextlib.contextmanager
    def connect() -> Iterator[psycopg.Connection]:
        tries[0] += 1
        if tries[0] >= 3:
            raise TaskTimeout("Timeout, PID: 1")
        raise psycopg.OperationalError("connection failed: Connection refused")
        yield  # pragma: no cover

    log = logging.getLogger("adv33a.connect_room_timeout")
    with caplog.at_level(logging.WARNING, logger=log.name):
        room = connect_when_room(connect, "the outbound ledger", log, lambda s: None, within=5)
        with pytest.raises(TaskTimeout), room():
            pass
    said = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert said and "waiting up to" in said[0], said
    assert not any("still refused" in line for line in said), said


def test_the_time_waited_counts_the_refused_tries_themselves() -> None:
    """A refusal may itself take time: a psycopg_pool's PoolTimeout after its own timeout, a
    ConnectionTimeout after ``connect_timeout``. The time waited (the run's database_wait
    metric, "the wait is timed", docs/deploying.md) is the whole wait, not only the pauses
    between the tries (adv33a: it was about a tenth of it)."""
    tries = [0]

    @contextlib.contextmanager
    def connect() -> Iterator[psycopg.Connection]:
        tries[0] += 1
        if tries[0] <= 2:
            time.sleep(0.3)  # a pool's timeout, then its refusal
            raise psycopg.errors.ConnectionTimeout("connection timeout expired")
        yield None  # type: ignore[misc]

    waited: list[float] = []
    log = logging.getLogger("adv33a.connect_room_waited")
    began = time.monotonic()
    with connect_when_room(connect, "the outbound ledger", log, waited.append, within=5)():
        elapsed = time.monotonic() - began
    assert tries == [3]
    assert len(waited) == 1 and waited[0] >= 0.6, (waited, elapsed)
