"""Every function that decides, tried with Hypothesis on real PostgreSQL (issue 30, item 6).

- the run's decision (refuse, no-op, run: new, rerun or taking over a crashed attempt; dry run
  or not; forced or not), for any sequence of runs of one key, against a reference written
  from the docs (README, docs/fence.md);
- the ledger's claim (send, skip, refuse a changed request, hold an unknown effect), for any
  stored state of each key of a batch;
- a resolution (mark sent, resend), for any stored status, intent age, state of the attempt
  that recorded the intent, and whether an attempt of the key runs.

Each example uses keys of its own in one database; examples are few (about 10 s in all).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from airflow_idempotency import schema as schema_mod
from airflow_idempotency._sql import query
from airflow_idempotency.effects.resolutions import ACTIONS, IN_FLIGHT_BOUND, resolve_unknown
from airflow_idempotency.exceptions import InvalidInputError, LockLostError, RunLockedError
from airflow_idempotency.ledger.claim import Batch, classify
from airflow_idempotency.ledger.outcomes import LedgerSummary
from airflow_idempotency.ledger.senders import Effect
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.runner import RunContext, RunOptions, RunOutcome, run_idempotently
from support.db import rows
from support.locks import terminate_lock_session

SCHEMA = "idempotency"
JOB = "props"
REMOTE = "props-remote"
_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_serial = itertools.count()


def _fresh(prefix: str) -> str:
    return f"{prefix}-{next(_serial)}"


@pytest.fixture
def db(pg_dsn: str) -> str:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        schema_mod.ensure_schema(conn, SCHEMA)
    return pg_dsn


@contextlib.contextmanager
def lock_held_elsewhere(dsn: str, run_key: str) -> Iterator[None]:
    """Another session holds the run lock of (JOB, run_key) while the block runs."""
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (run_lock_key(JOB, run_key),))
        yield


# -- the run's decision --------------------------------------------------------------------

STEP = st.one_of(
    st.tuples(
        st.sampled_from(["succeed", "fail", "crash", "held", "killed"]),
        st.booleans(),
        st.just(False),
    ),
    st.tuples(st.sampled_from(["succeed", "fail", "held"]), st.booleans(), st.just(True)),
)


def _status(dsn: str, run_key: str) -> str | None:
    found = rows(dsn, "SELECT status FROM idempotency.job_runs WHERE run_key = %s", (run_key,))
    return found[0][0] if found else None


def _running_attempts(dsn: str, run_key: str) -> int:
    sql = "SELECT count(*) FROM idempotency.job_run_attempts WHERE run_key = %s AND outcome = 'running'"
    return int(rows(dsn, sql, (run_key,))[0][0])


def _killed_after_start(dsn: str, run_key: str) -> None:
    """A worker killed after its start: its attempt left running, the key started by it."""
    lock_key = run_lock_key(JOB, run_key)
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(  # its start closed any attempt left running before it, as every start does
            "UPDATE idempotency.job_run_attempts SET outcome = 'lock_lost', finished_at = now() "
            "WHERE job_name = %s AND run_key = %s AND outcome = 'running'",
            (JOB, run_key),
        )
        found = conn.execute(
            "INSERT INTO idempotency.job_run_attempts (job_name, run_key, lock_key, outcome, "
            "triggered_by, hostname, pid) VALUES (%s, %s, %s, 'running', 'test', 'gone', 1) "
            "RETURNING attempt_id",
            (JOB, run_key, lock_key),
        ).fetchone()
        assert found is not None
        conn.execute(
            "INSERT INTO idempotency.job_runs (job_name, run_key, lock_key, status, triggered_by, "
            "attempt_count, current_attempt_id, started_at) VALUES (%s, %s, %s, 'started', "
            "'test', 1, %s, now()) ON CONFLICT (job_name, run_key) DO UPDATE SET "
            "status = 'started', current_attempt_id = EXCLUDED.current_attempt_id",
            (JOB, run_key, lock_key, found[0]),
        )


def _one_run(dsn: str, run_key: str, kind: str, force: bool, dry_run: bool) -> tuple[Any, int]:
    """Run the key once; what it returned or raised, and how often the work was called."""
    calls = []

    def work(ctx: RunContext) -> dict[str, int]:
        calls.append(1)
        if kind == "fail":
            raise ZeroDivisionError("the work failed")
        if kind == "crash":  # the worker's lock session ends: a killed worker, as seen by PG
            terminate_lock_session(dsn, JOB, run_key)
        return {"n": 1}

    run: dict[str, Any] = {"connect": lambda: psycopg.connect(dsn), "job_name": JOB}
    options = RunOptions(force=force, dry_run=dry_run)
    try:
        with lock_held_elsewhere(dsn, run_key) if kind == "held" else contextlib.nullcontext():
            result: Any = run_idempotently(**run, run_key=run_key, work=work, options=options)
    except Exception as exc:  # the decision is what is checked
        result = exc
    return result, len(calls)


@settings(_SETTINGS, max_examples=60)
@given(steps=st.lists(STEP, min_size=1, max_size=4))
@example(steps=[("succeed", False, False), ("succeed", True, False), ("fail", False, True)])
@example(steps=[("killed", False, False), ("succeed", False, True), ("crash", False, False)])
def test_the_run_decides_as_documented(db: str, steps: list[tuple[str, bool, bool]]) -> None:
    run_key = _fresh("run")
    status: str | None = None  # the reference: job_runs.status of the key
    left_running = 0  # the reference: attempts of a killed worker, until a start takes over
    for kind, force, dry_run in steps:
        if kind == "killed":
            _killed_after_start(db, run_key)
            status, left_running = "started", 1
            continue
        result, calls = _one_run(db, run_key, kind, force, dry_run)
        where = f"after {kind} force={force} dry_run={dry_run} on {status}: {result!r}"
        if kind == "held":  # refused, nothing called, nothing changed
            assert isinstance(result, RunLockedError) and calls == 0, where
        elif status == "completed" and not force:  # a no-op, dry run or not
            assert calls == 0, where
            assert getattr(result, "outcome", None) is RunOutcome.NOOP, where
        else:  # the work runs once; a real start takes a killed worker's attempt over
            assert calls == 1, where
            if not dry_run:
                status = {"succeed": "completed", "fail": "failed", "crash": "failed"}[kind]
                left_running = 0
            if kind == "succeed":
                want = RunOutcome.DRY_RUN if dry_run else RunOutcome.COMPLETED
                assert getattr(result, "outcome", None) is want, where
            else:  # a lost lock is recorded failed too: the rerun converges
                assert isinstance(result, ZeroDivisionError if kind == "fail" else LockLostError)
        assert _status(db, run_key) == status, where
        assert _running_attempts(db, run_key) == left_running, where


# -- the zone rule, decided in run_decide (migration 16) ------------------------------------

ZONES = ["UTC", "Etc/UTC", "+00:00", "Europe/Amsterdam", "Europe/Kyiv", "Europe/Kiev"]


def _attempts(dsn: str, job: str) -> int:
    sql = "SELECT count(*) FROM idempotency.job_run_attempts WHERE job_name = %s"
    return int(rows(dsn, sql, (job,))[0][0])


@settings(_SETTINGS, max_examples=30)
@given(
    first=st.sampled_from(ZONES),
    then=st.sampled_from(ZONES),
    same_key=st.booleans(),
    force=st.booleans(),
)
@example(first="UTC", then="Etc/UTC", same_key=True, force=False)
@example(first="Europe/Kyiv", then="Europe/Kiev", same_key=False, force=False)
@example(first="UTC", then="Europe/Amsterdam", same_key=True, force=False)
def test_the_zone_rule_refuses_only_another_zone(
    db: str, first: str, then: str, same_key: bool, force: bool
) -> None:
    """A job's key made in one zone, then a run of it (the same key or another) made in a
    zone written any way: refused before anything is written (no attempt, no lock tried)
    exactly when the zones differ (key_zone.same_zone); otherwise decided as any run (a
    completed key not forced is a no-op)."""
    from airflow_idempotency import ConfigurationError
    from airflow_idempotency.key_zone import same_zone
    from airflow_idempotency.records import Trigger

    job = _fresh("zones")
    keys = ["2026-10-01", "2026-10-01" if same_key else "2026-10-02"]
    run: dict[str, Any] = {"connect": lambda: psycopg.connect(db), "job_name": job}
    done = run_idempotently(
        **run, run_key=keys[0], work=lambda ctx: None, trigger=Trigger(key_zone=first)
    )
    assert done.outcome is RunOutcome.COMPLETED
    before = _attempts(db, job)
    calls: list[int] = []
    try:
        result: Any = run_idempotently(
            **run,
            run_key=keys[1],
            work=lambda ctx: calls.append(1),
            trigger=Trigger(key_zone=then),
            options=RunOptions(force=force),
        )
    except ConfigurationError as exc:
        result = exc
    if not same_zone(first, then):
        assert isinstance(result, ConfigurationError) and first in str(result), result
        assert calls == [] and _attempts(db, job) == before, result
    elif same_key and not force:
        assert result.outcome is RunOutcome.NOOP and calls == [], result
        assert _attempts(db, job) == before + 1
    else:
        assert result.outcome is RunOutcome.COMPLETED and calls == [1], result


# -- the ledger's claim ---------------------------------------------------------------------

STORED = st.sampled_from(["absent", "pending", "failed", "succeeded", "unknown"])


def _insert_effect(conn: psycopg.Connection, key: str, status: str, fingerprint: str) -> None:
    conn.execute(
        "INSERT INTO idempotency.outbound_ledger (remote_system, idempotency_key, job_name, "
        "run_key, request_fingerprint, status, intent_at) VALUES (%s, %s, %s, 'k', %s, %s, "
        "CASE WHEN %s = 'unknown' THEN statement_timestamp() END)",
        (REMOTE, key, JOB, fingerprint, status, status),
    )


def _ledger(dsn: str, keys: list[str]) -> dict[str, tuple[str, str]]:
    sql = (
        "SELECT idempotency_key, status, request_fingerprint FROM idempotency.outbound_ledger "
        "WHERE remote_system = %s AND idempotency_key = ANY(%s)"
    )
    return {key: (status, fp) for key, status, fp in rows(dsn, sql, (REMOTE, keys))}


@_SETTINGS
@given(stored=st.lists(st.tuples(STORED, st.booleans()), min_size=1, max_size=6))
def test_the_claim_sends_skips_and_refuses_as_documented(
    db: str, stored: list[tuple[str, bool]]
) -> None:
    effects = [Effect(_fresh("claim"), {"amount": 100}) for _ in stored]
    keys = [effect.idempotency_key for effect in effects]
    new = effects[0].fingerprint
    with psycopg.connect(db, autocommit=True) as conn:
        for key, (state, same) in zip(keys, stored, strict=True):
            if state != "absent":
                _insert_effect(conn, key, state, new if same else "a-different-request")
        before = _ledger(db, keys)
        params = {
            "keys": keys, "fingerprints": [new] * len(keys), "remote_system": REMOTE,
            "job_name": JOB, "run_key": "k", "attempt_id": None, "effect_kind": "http",
            "deduplicating": True,
        }  # fmt: skip
        with conn.transaction():
            found = conn.execute(query("ledger_claim_batch", SCHEMA), params).fetchall()
    summary = LedgerSummary()
    batch = Batch(effects, keys, [new] * len(keys), {k: i for i, k in enumerate(keys)})
    sent = {effect.idempotency_key for effect in classify(batch, found, summary)}

    def expected(state: str, same: bool) -> str:
        if state != "absent" and not same:
            return "conflict"
        return {"absent": "send", "pending": "send", "failed": "send", "succeeded": "skip"}.get(
            state, "unknown"
        )

    verdicts = [expected(state, same) for state, same in stored]
    assert sent == {k for k, v in zip(keys, verdicts, strict=True) if v == "send"}, verdicts
    assert summary.conflicts == verdicts.count("conflict"), verdicts
    assert summary.unknown == verdicts.count("unknown"), verdicts
    assert summary.skipped_existing == verdicts.count("skip"), verdicts
    assert summary.total == len(keys)
    after = _ledger(db, keys)
    for key, (state, _same) in zip(keys, stored, strict=True):
        # a new key is claimed pending for this request; a known one is left as it was
        assert after[key] == (before[key] if state != "absent" else ("pending", new)), key


# -- a resolution ---------------------------------------------------------------------------

ATTEMPTS = ["none", "running", "completed", "abandoned", "abandoned_then_ended"]


def _insert_attempt(conn: psycopg.Connection, run_key: str, state: str) -> int | None:
    if state == "none":
        return None
    outcome = {"running": "running", "completed": "completed"}.get(state, "lock_lost")
    error = "abandoned: the worker ended without finishing" if "abandoned" in state else None
    details = {"late_outcome": "failed"} if state == "abandoned_then_ended" else {}
    found = conn.execute(
        "INSERT INTO idempotency.job_run_attempts (job_name, run_key, lock_key, outcome, "
        "triggered_by, hostname, pid, error, details) VALUES (%s, %s, %s, %s, 'test', 'host', "
        "1, %s, %s) RETURNING attempt_id",
        (JOB, run_key, run_lock_key(JOB, run_key), outcome, error, Jsonb(details)),
    ).fetchone()
    assert found is not None
    return int(found[0])


@_SETTINGS
@given(
    status=st.sampled_from(["pending", "failed", "succeeded", "unknown"]),
    recent=st.booleans(),
    attempt=st.sampled_from(ATTEMPTS),
    locked=st.booleans(),
    action=st.sampled_from(ACTIONS),
)
def test_a_resolution_moves_only_an_unknown_effect_no_call_can_still_be_making(
    db: str, status: str, recent: bool, attempt: str, locked: bool, action: Any
) -> None:
    run_key, key = _fresh("resolve-run"), _fresh("resolve")
    age = 1.0 if recent else IN_FLIGHT_BOUND + 60
    with psycopg.connect(db, autocommit=True) as conn:
        attempt_id = _insert_attempt(conn, run_key, attempt)
        conn.execute(
            "INSERT INTO idempotency.outbound_ledger (remote_system, idempotency_key, job_name, "
            "run_key, request_fingerprint, status, intent_at, last_attempt_id, deduplicating) "
            "VALUES (%s, %s, %s, %s, 'fp', %s, statement_timestamp() - make_interval(secs => %s), "
            "%s, false)",
            (REMOTE, key, JOB, run_key, status, age, attempt_id),
        )
        call = {
            "remote_system": REMOTE, "idempotency_key": key, "action": action,
            "resolved_by": "ops", "reason": "checked the mailbox",
        }  # fmt: skip
        try:
            with lock_held_elsewhere(db, run_key) if locked else contextlib.nullcontext():
                outcome: Any = resolve_unknown(conn, SCHEMA, **call)
        except (RunLockedError, InvalidInputError) as exc:
            outcome = exc
    in_flight = recent and attempt in ("none", "running", "abandoned")
    if locked:
        expected: type | str = RunLockedError  # an attempt of the key runs
    elif status != "unknown":
        expected = InvalidInputError  # only an unknown effect is resolved
    elif in_flight:
        expected = RunLockedError  # its call may still be under way
    else:
        expected = "succeeded" if action == "mark_sent" else "pending"
    stored = rows(
        db,
        "SELECT l.status, count(r.*) FROM idempotency.outbound_ledger AS l LEFT JOIN "
        "idempotency.outbound_ledger_resolutions AS r USING (ledger_id) "
        "WHERE l.idempotency_key = %s GROUP BY l.status",
        (key,),
    )
    where = f"{status=} {recent=} {attempt=} {locked=} {action=}: {outcome!r}"
    if isinstance(expected, str):
        assert getattr(outcome, "new_status", None) == expected, where
        assert stored == [(expected, 1)], where
    else:
        assert isinstance(outcome, expected), where
        assert stored == [(status, 0)], where  # nothing written
