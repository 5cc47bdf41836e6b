"""An adversary's pass over ``WorkDeferred`` (a work that defers: docs/policy.md, deferrable
operators) on a real PostgreSQL, in both lock modes, below Airflow:

- the fence: a fenced transaction the deferred attempt left open cannot commit after the
  deferral released the key;
- the ledger: effects confirmed before a deferral are not resent by the resumption (the same
  keys), and the resumption sends only the new ones;
- the decision, with Hypothesis: any sequence of deferrals, resumptions, failures and
  completions of one key, forced or not, dry or not, against a reference: a deferral leaves
  the key started, a completed key is a no-op unless forced, at most one completion per key
  beyond the forced ones, and the attempts tell the story (one row per call).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from airflow_idempotency import schema as schema_mod
from airflow_idempotency.ledger import BlockingEffectSender, Confirmation, Effect, OutboundLedger
from airflow_idempotency.run_steps import WorkDeferred
from airflow_idempotency.runner import RunContext, RunOptions, RunOutcome, run_idempotently
from support.db import rows

JOB = "deferring"
MODES = ["advisory", "lease"]
_serial = itertools.count()


class Deferral(BaseException):
    """Stands for Airflow's TaskDeferred (a BaseException on 3.x)."""


@pytest.fixture
def db(pg_dsn: str) -> str:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        schema_mod.ensure_schema(conn, "idempotency")
        conn.execute("CREATE TABLE public.loaded (run_key text)")
    return pg_dsn


def _run(dsn: str, run_key: str, work: Any, mode: str, **options: bool) -> Any:
    return run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=JOB,
        run_key=run_key,
        work=work,
        lock_mode=mode,
        options=RunOptions(**options),
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_transaction_left_open_by_a_deferred_attempt_cannot_commit_after_the_deferral(
    db: str, mode: str
) -> None:
    """The work opens a fenced transaction on a connection of its own, writes, and defers
    without ending it: once the deferral released the key, its COMMIT is refused and nothing
    of it lands (the fence holds across a deferral as across a lost lock)."""
    left_open = contextlib.ExitStack()

    def work(ctx: RunContext) -> None:
        conn = left_open.enter_context(ctx.bookkeeping_connection())
        left_open.enter_context(ctx.fenced_transaction(conn))
        conn.execute("INSERT INTO public.loaded VALUES (%s)", (ctx.run_key,))
        raise WorkDeferred(Deferral("waiting for a trigger"))

    with pytest.raises(WorkDeferred):
        _run(db, "2026-10-01", work, mode)
    with pytest.raises(psycopg.Error):
        left_open.close()  # the COMMIT of the transaction left open
    assert rows(db, "SELECT run_key FROM public.loaded") == []
    assert _run(db, "2026-10-01", lambda ctx: {"n": 1}, mode).outcome is RunOutcome.COMPLETED


class CountingSender(BlockingEffectSender[None]):
    """A deduplicating remote's stand-in that counts each key it was called with."""

    kind = "custom"
    deduplicating = False

    def __init__(self) -> None:
        self.calls: list[str] = []

    def connect(self) -> None:
        return None

    def send(self, connection: None, effect: Effect) -> Confirmation:
        self.calls.append(effect.idempotency_key)
        return Confirmation(reference=f"ref-{effect.idempotency_key}")


@pytest.mark.parametrize("mode", MODES)
def test_effects_confirmed_before_a_deferral_are_not_resent_by_the_resumption(
    db: str, mode: str
) -> None:
    """Part one sends two effects and defers; the resumption sends the same two and a third:
    only the third goes out, the key completes once."""
    sender = CountingSender()

    def effects(n: int) -> list[Effect]:
        return [Effect(f"2026-10-02/{i}", {"i": i}) for i in range(n)]

    def first(ctx: RunContext) -> None:
        OutboundLedger(ctx, "remote").send_all(effects(2), sender)
        raise WorkDeferred(Deferral("waiting"))

    def resumed(ctx: RunContext) -> dict[str, int]:
        summary = OutboundLedger(ctx, "remote").send_all(effects(3), sender)
        return {"sent": summary.sent, "skipped": summary.skipped_existing}

    with pytest.raises(WorkDeferred):
        _run(db, "2026-10-02", first, mode)
    result = _run(db, "2026-10-02", resumed, mode)
    assert result.outcome is RunOutcome.COMPLETED
    # each effect once; the ledger sends concurrently, so in no particular order
    assert sorted(sender.calls) == ["2026-10-02/0", "2026-10-02/1", "2026-10-02/2"]
    assert result.counts == {"sent": 1, "skipped": 2}


# -- the decision, with Hypothesis -----------------------------------------------------------

# (what the work does, force, dry_run)
STEP = st.tuples(st.sampled_from(["defer", "succeed", "fail"]), st.booleans(), st.booleans())


@settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(STEP, min_size=1, max_size=5), mode=st.sampled_from(MODES))
@example(
    steps=[("defer", False, False), ("succeed", False, False), ("defer", False, False)],
    mode="advisory",
)
@example(
    steps=[("succeed", False, False), ("defer", True, False), ("succeed", False, False)],
    mode="lease",
)
@example(
    steps=[("defer", False, True), ("succeed", False, True), ("succeed", False, False)],
    mode="advisory",
)
def test_deferrals_resumptions_and_forces_decide_as_documented(
    db: str, steps: list[tuple[str, bool, bool]], mode: str
) -> None:
    run_key = f"key-{next(_serial)}"
    status: str | None = None  # the reference: job_runs.status
    outcomes: list[str] = []  # the reference: the attempts, in order
    for kind, force, dry_run in steps:
        calls: list[int] = []

        def work(ctx: RunContext, kind: str = kind, calls: list[int] = calls) -> dict[str, int]:
            calls.append(1)
            if kind == "defer":
                raise WorkDeferred(Deferral("waiting"))
            if kind == "fail":
                raise ZeroDivisionError("failed")
            return {"n": 1}

        try:
            result: Any = _run(db, run_key, work, mode, force=force, dry_run=dry_run)
        except (WorkDeferred, ZeroDivisionError) as exc:
            result = exc
        where = f"{kind} force={force} dry_run={dry_run} on {status}: {result!r}"
        if status == "completed" and not force:
            assert calls == [] and result.outcome is RunOutcome.NOOP, where
            outcomes.append("noop")
        else:
            assert calls == [1], where
            if kind == "defer":
                assert isinstance(result, WorkDeferred), where
                outcomes.append("deferred")
                status = status if dry_run else "started"
            elif kind == "fail":
                assert isinstance(result, ZeroDivisionError), where
                outcomes.append("failed")
                status = status if dry_run else "failed"
            else:
                outcomes.append("dry_run" if dry_run else "completed")
                status = status if dry_run else "completed"
        found = rows(db, "SELECT status FROM idempotency.job_runs WHERE run_key = %s", (run_key,))
        assert (found[0][0] if found else None) == status, where
        attempts = rows(
            db,
            "SELECT outcome, force, dry_run FROM idempotency.job_run_attempts "
            "WHERE run_key = %s ORDER BY attempt_id",
            (run_key,),
        )
        assert [a[0] for a in attempts] == outcomes, where
        # a completion beyond the first needs a forced attempt (a recompute) before it
        forced = [a for a in attempts if a[1] and not a[2]]
        unforced_completions = [a for a in attempts if a[0] == "completed" and not a[1]]
        assert len(unforced_completions) <= 1 + len(forced), where
        assert not [a for a in attempts if a[2] and a[0] == "completed"], where
