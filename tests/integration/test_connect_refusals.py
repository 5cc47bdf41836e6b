"""Which refused connections a run waits out (run_context.connect_when_room: the completion's and
the outbound ledger's, opened after committed work; issue 32): a want of a slot
(locks.no_slot) or a database that cannot take the connection for the moment
(locks.unreachable_for_now: a restart, a failover, no answer in time), and nothing else: a
permanent refusal (a database that does not exist, a host that does not resolve) is raised at
once, not waited on for the whole lock wait."""

from __future__ import annotations

import logging
import socket
import time
import uuid

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg.conninfo import make_conninfo

from airflow_idempotency.locks import _UNREACHABLE, LOCK_WAIT_ENV, no_slot, unreachable_for_now
from airflow_idempotency.run_context import connect_when_room


def closed_port() -> int:
    """A local port nothing listens on (bound, then closed: connections to it are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def refusal(dsn: str) -> psycopg.OperationalError:
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(dsn, connect_timeout=2)
    return refused.value


def refused_within(
    dsn: str, bound: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[float, list[float], str]:
    """Ask connect_when_room for a connection to ``dsn`` with the lock wait at ``bound``
    seconds; the seconds it took to raise, the pauses it reported and the error's words."""
    monkeypatch.setenv(LOCK_WAIT_ENV, bound)
    paused: list[float] = []
    connection = connect_when_room(
        lambda: psycopg.connect(dsn), "the completion", logging.getLogger(__name__), paused.append
    )
    began = time.monotonic()
    with pytest.raises(psycopg.OperationalError) as refused, connection():
        pass
    assert not isinstance(refused.value, psycopg.errors.ConnectionTimeout), refused.value
    return time.monotonic() - began, paused, str(refused.value)


def test_nothing_listening_is_waited_out_and_a_permanent_refusal_is_not(pg_dsn: str) -> None:
    down = refusal(make_conninfo(pg_dsn, host="127.0.0.1", port=closed_port()))
    assert unreachable_for_now(down) and not no_slot(down), down
    missing = refusal(make_conninfo(pg_dsn, dbname=f"adv_missing_{uuid.uuid4().hex[:8]}"))
    assert not unreachable_for_now(missing) and not no_slot(missing), missing
    unresolved = refusal(make_conninfo(pg_dsn, host="no-such-host.invalid"))
    assert not unreachable_for_now(unresolved) and not no_slot(unresolved), unresolved


def test_a_permanent_refusal_is_raised_at_once_within_a_long_bound(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The bound is 30 s here: a database that does not exist is raised on the first try, with
    no pause and nothing said about waiting."""
    caplog.set_level(logging.WARNING)
    dsn = make_conninfo(pg_dsn, dbname=f"adv_missing_{uuid.uuid4().hex[:8]}")
    took, paused, said = refused_within(dsn, "30", monkeypatch)
    assert "does not exist" in said, said
    assert took < 5 and paused == []
    assert not [r for r in caplog.records if "waiting" in r.getMessage()]


def test_nothing_listening_for_good_waits_its_bound_and_says_it_gave_up(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    took, paused, refusal = refused_within(
        make_conninfo(pg_dsn, host="127.0.0.1", port=closed_port()), "1", monkeypatch
    )
    assert "Connection refused" in refusal, refusal
    assert 1.0 <= took < 3 and 0.5 <= sum(paused) <= 1.0, paused
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "waiting up to 1 s for it to answer again" in said[0], said
    assert "giving up" in said[1] and LOCK_WAIT_ENV in said[1], said


@given(text=st.text(max_size=80), marker=st.sampled_from(_UNREACHABLE), cut=st.integers(0, 80))
def test_unreachable_is_any_operational_error_naming_a_transient_refusal(
    text: str, marker: str, cut: int
) -> None:
    """A psycopg OperationalError is waited out when its text names one of the transient
    refusals, wherever the words stand; the same words in another kind of error are not."""
    named = text[:cut] + marker + text[cut:]
    assert unreachable_for_now(psycopg.OperationalError(named))
    assert not unreachable_for_now(psycopg.ProgrammingError(named))
    assert not unreachable_for_now(ValueError(named))
    plain = psycopg.OperationalError(text)
    assert unreachable_for_now(plain) == any(m in text for m in _UNREACHABLE)
