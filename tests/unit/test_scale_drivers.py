"""The scale benchmark's multi-process driver (bench/scale_drivers.py): how it splits the runs
over its processes and how a run's failure crosses from a process to the cell's tally."""

from __future__ import annotations

import pickle

from hypothesis import given
from hypothesis import strategies as st

from bench.scale_drivers import Outcome, RunError, _portable, _shares, error_name


@given(st.integers(1, 2_000), st.integers(1, 64))
def test_shares_cover_every_run_once_and_differ_by_at_most_one(runs: int, processes: int) -> None:
    processes = min(processes, runs)
    shares = _shares(runs, processes)
    assert len(shares) == processes
    assert [i for share in shares for i in share] == list(range(runs))
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_a_failure_crosses_processes_by_its_class_name_and_message() -> None:
    """A run's exception may not pickle (psycopg's carry a connection's state): the driver
    process sends its class name and message, which the cell counts as the in-process
    driver counts the exception itself."""
    original = TimeoutError("waited 60 s for a server connection")
    sent = _portable(Outcome(1.5, None, original, 10.0))
    received = pickle.loads(pickle.dumps(sent))
    assert isinstance(received.error, RunError)
    assert error_name(received.error) == error_name(original) == "TimeoutError"
    assert str(received.error) == str(original)
    assert (received.seconds, received.work_seconds, received.ended) == (1.5, None, 10.0)
    ok = Outcome(2.0, 1.9, None, 11.0)
    assert _portable(ok) is ok
