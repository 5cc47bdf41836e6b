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
