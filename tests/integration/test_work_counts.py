"""The counts a work function returns are stored in ``job_runs.details`` (jsonb) by the
completion, after the work committed. Counts that jsonb cannot hold (NaN, an infinity, a NUL
character, half of a surrogate pair, a key JSON has no spelling for) are refused with an error
naming them as soon as the work returns: the attempt and the run are recorded ``failed``, in
both lock modes. (They used to fail the completion's write itself with PostgreSQL's words, the
attempt left ``running`` and the run ``started`` in the advisory mode.) So is the message of an
error the work raises: recorded escaped where a text column cannot hold it, never masked."""

from __future__ import annotations

import json
import math
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.records import storable_counts
from airflow_idempotency.runner import RunContext, RunOutcome, run_idempotently
from support.db import rows

UNSTORABLE: dict[str, dict[Any, Any]] = {
    "nan": {"ratio": math.nan},
    "infinity": {"ratio": -math.inf},
    "nul in a string": {"note": "a\x00b"},
    "nul in a key": {"a\x00b": 1},
    "nul deep down": {"by_day": [{"2026-10-01": ["ok", "x\x00"]}]},
    "half a surrogate pair": {"note": "\ud800"},
    "a tuple key": {("a", "b"): 1},
    "an object": {"when": object()},
}


@pytest.mark.parametrize("lock_mode", ["advisory", "lease"])
@pytest.mark.parametrize("name", sorted(UNSTORABLE))
def test_counts_jsonb_cannot_hold_fail_the_run_cleanly(
    pg_dsn: str, lock_mode: str, name: str
) -> None:
    key = f"{lock_mode}-{name}"

    def work(run: RunContext) -> dict[Any, Any]:
        with run.transaction() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS counted (k text)")
            conn.execute("INSERT INTO counted VALUES (%s)", (run.run_key,))
        return UNSTORABLE[name]

    with pytest.raises(InvalidInputError, match="the work function returned counts"):
        run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn), job_name="counts", run_key=key,
            work=work, lock_mode=lock_mode,
        )  # fmt: skip
    status = "SELECT status FROM idempotency.job_runs WHERE job_name = 'counts' AND run_key = %s"
    assert rows(pg_dsn, status, (key,)) == [("failed",)]
    outcomes = rows(
        pg_dsn,
        "SELECT outcome, error FROM idempotency.job_run_attempts"
        " WHERE job_name = 'counts' AND run_key = %s",
        (key,),
    )
    assert [o for o, _ in outcomes] == ["failed"]
    assert "the work function returned counts" in outcomes[0][1]

    def fixed(run: RunContext) -> dict[str, int]:
        return {"rows": 1}

    result = run_idempotently(
        connect=lambda: psycopg.connect(pg_dsn), job_name="counts", run_key=key, work=fixed,
        lock_mode=lock_mode,
    )  # fmt: skip
    assert result.outcome is RunOutcome.COMPLETED  # the rerun converges once the work is fixed


def _values() -> st.SearchStrategy[Any]:
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
        max_leaves=6,
    )


@pytest.fixture
def jsonb(pg_dsn: str) -> Any:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=st.dictionaries(st.text(max_size=4), _values(), max_size=4))
def test_the_check_accepts_exactly_what_jsonb_stores(jsonb: Any, counts: dict[str, Any]) -> None:
    """Whatever the work returns, the check and PostgreSQL agree: accepted counts are stored as
    jsonb (and read back equal), refused ones would have been refused by jsonb too."""
    try:
        accepted = storable_counts(counts)
    except InvalidInputError:
        accepted = None
    try:
        (stored,) = jsonb.execute("SELECT %s::jsonb", (json.dumps(counts),)).fetchone()
    except psycopg.Error:
        stored = None
    except (UnicodeEncodeError, ValueError):
        stored = None  # not even sent: the text is no UTF-8
    if accepted is None:
        assert stored is None or not _same(stored, counts), counts
    else:
        assert stored is not None, counts
        assert _same(stored, counts), (stored, counts)


def _same(stored: Any, counts: Any) -> bool:
    """Equal as JSON, numbers compared as floats: jsonb stores a number as numeric, so a float
    such as 4.558230734422927e+16 comes back as the integer it spells."""

    def normal(value: Any) -> Any:
        return json.loads(json.dumps(value), parse_int=float, parse_float=float)

    return bool(normal(stored) == normal(counts))


@pytest.mark.parametrize("lock_mode", ["advisory", "lease"])
def test_a_work_error_a_text_column_cannot_hold_is_recorded_escaped(
    pg_dsn: str, lock_mode: str
) -> None:
    """The work's error carries a NUL character and half of a surrogate pair (words of a remote,
    say): the work's own error reaches the caller, and the attempt and the run are recorded
    failed with the message backslash-escaped. (Recording it failed: psycopg's
    UnicodeEncodeError replaced the work's error, the attempt was left running.)"""
    key = f"{lock_mode}-error"

    def work(run: RunContext) -> None:
        raise ValueError("the remote said \x00 and \ud800")

    with pytest.raises(ValueError, match="the remote said"):
        run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn), job_name="errors", run_key=key, work=work,
            lock_mode=lock_mode,
        )  # fmt: skip
    found = rows(
        pg_dsn,
        "SELECT r.status, a.outcome, a.error FROM idempotency.job_runs r"
        " JOIN idempotency.job_run_attempts a USING (job_name, run_key)"
        " WHERE job_name = 'errors' AND run_key = %s",
        (key,),
    )
    assert [(s, o) for s, o, _ in found] == [("failed", "failed")], found
    assert "the remote said \\x00 and \\ud800" in found[0][2], found
