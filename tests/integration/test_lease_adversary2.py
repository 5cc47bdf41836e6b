"""A second adversary's pass over the lease lock mode (issue 32: migrations 18 to 20, the lease
decision, the start's re-read, the lock order): each test is one attack on a database of its
own. A failing test here is a defect found (its docstring says what breaks); a passing one is an
attack that held."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_idempotency import records
from airflow_idempotency.cli import main
from airflow_idempotency.exceptions import LockLostError
from airflow_idempotency.leases import LockMode
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.runner import RunContext, RunResult, run_idempotently
from support.db import rows
from support.locks import (
    Background,
    chain,
    expire_lease,
    lock_waiters,
    lose_first_completion,
    wait_for,
)

JOB, KEY = "adv2_job", "2026-11-03"
LOCK_KEY = run_lock_key(JOB, KEY)
# renewed every 100 s: no renewal during a test; expire_lease ends it when the test says
LONG = LockMode("lease", lease_ttl=300)


def run_in(dsn: str, work: Any, lock_mode: str | LockMode = LONG, **more: Any) -> RunResult:
    return run_idempotently(
        connect=lambda: psycopg.connect(dsn),
        job_name=JOB,
        run_key=KEY,
        work=work,
        lock_mode=lock_mode,
        **more,
    )


def written(dsn: str) -> list[str]:
    return [w for (w,) in rows(dsn, "SELECT writer FROM public.facts ORDER BY writer")]


def test_a_reset_racing_the_completion_of_an_expired_lease_never_deadlocks(
    adv_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`reset` of a key whose lease expired while its worker still runs (a late heartbeat: the
    lease is held until taken over) takes the lease over: lease_live deletes the lease row,
    THEN reset locks the run's row (reset_run). The holder's completion locks the run's row
    (complete_attempt_lease), THEN deletes its lease at its COMMIT (lease_release_on_commit).
    Opposite orders: when the completion lands between the two, each waits for the other and
    PostgreSQL's deadlock detector kills one after deadlock_timeout (a raw DeadlockDetected
    for the worker or the operator). Expected: one waits for the other, never both."""
    go = threading.Event()

    def work(ctx: RunContext) -> dict[str, int]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('holder', %s)", (ctx.run_key,))
        assert go.wait(30)
        return {}

    holder = Background(lambda: run_in(adv_db, work))
    wait_for("the holder's work", lambda: written(adv_db) == ["holder"])
    expire_lease(adv_db, JOB, KEY)  # its heartbeat late: the lease expired, nobody took it

    paused, resume = threading.Event(), threading.Event()
    get_run = records.get_run

    def get_run_paused(*args: Any, **kwargs: Any) -> Any:  # reset: after lease_live
        paused.set()
        assert resume.wait(30)
        return get_run(*args, **kwargs)

    monkeypatch.setattr(records, "get_run", get_run_paused)
    reset = Background(lambda: main(["reset", JOB, KEY, "--reason", "stuck", "--dsn", adv_db]))
    assert paused.wait(30)
    go.set()  # the holder completes now, while reset holds what it locked so far
    wait_for("the completion to wait for reset", lambda: bool(lock_waiters(adv_db)))
    resume.set()
    reset.join()
    holder.join()
    said = f"reset: {chain(reset.error)}; holder: {chain(holder.error)}"
    assert "deadlock" not in said.lower(), said
    attempts = rows(adv_db, "SELECT outcome, error FROM idempotency.job_run_attempts")
    assert not any("deadlock" in (error or "") for _, error in attempts), attempts
    # reset went first: the key is failed (reset), the holder no longer owns it
    assert reset.result == 0, said
    assert isinstance(holder.error, LockLostError), said
    assert rows(adv_db, "SELECT status FROM idempotency.job_runs") == [("failed",)]
    assert rows(adv_db, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]


def test_adopt_racing_the_start_of_an_expired_lease_leaves_the_key_adopted(
    adv_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`adopt --apply` of a key without records while a lease-mode run of it decided (its lease
    taken) and its lease expired before its start (a paused worker): adopt takes the expired
    lease over (lease_live deletes it, under the key's advisory run lock, NOT the fence key)
    and records the key completed. The start's fence_take_over checks the lease before adopt's
    transaction commits (the row still there), then its upsert waits for adopt's row and
    overwrites the adopted, completed run with 'started'; its work is refused (the lease gone)
    and marks the key failed, so the next run does the adopted work again. Expected: the start
    is refused (its check at COMMIT sees the lease gone); the key stays completed, adopted."""
    from psycopg.types.json import Jsonb

    from airflow_idempotency._sql import query

    at_start, go = threading.Event(), threading.Event()
    start_attempt = records.RunRecords.start_attempt

    def start_paused(self: records.RunRecords, *args: Any, **kwargs: Any) -> Any:
        at_start.set()  # the decision took the lease; the worker pauses before its start
        assert go.wait(30)
        return start_attempt(self, *args, **kwargs)

    monkeypatch.setattr(records.RunRecords, "start_attempt", start_paused)

    def work(ctx: RunContext) -> None:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('worker', %s)", (ctx.run_key,))

    worker = Background(lambda: run_in(adv_db, work))
    assert at_start.wait(30)
    expire_lease(adv_db, JOB, KEY)
    params = {
        "job_name": JOB, "run_key": KEY, "lock_key": LOCK_KEY, "dag_id": "d", "run_id": "r",
        "task_id": "t", "hostname": "h", "pid": 1, "details": Jsonb({"adopted_from": {}}),
        "key_zone": None,
    }  # fmt: skip
    with psycopg.connect(adv_db) as adopt:  # adopt --apply's transaction of this key
        assert adopt.execute(query("adopt_lock", "idempotency"), params).fetchone() == (True,)
        live = adopt.execute(query("lease_live", "idempotency"), params).fetchone()
        assert live == (False,)  # expired: taken over, its row deleted
        assert adopt.execute(query("adopt_run", "idempotency"), params).fetchone() is not None
        go.set()
        # the start passes its check (the lease's row still there for it), then its upsert
        # waits for this transaction's row; or it is refused at once
        wait_for(
            "the start to wait for adopt, or end",
            lambda: bool(lock_waiters(adv_db)) or worker.finished_at is not None,
        )
        adopt.commit()
    worker.join()
    assert isinstance(worker.error, LockLostError), chain(worker.error)
    assert written(adv_db) == []
    assert rows(adv_db, "SELECT status, triggered_by FROM idempotency.job_runs") == [
        ("completed", "adopted")
    ], f"worker: {chain(worker.error)}"


def test_reset_leaves_an_expired_lease_alone_while_its_holder_has_a_transaction_open(
    adv_db: str,
) -> None:
    """An expired lease is taken over under the key's fence key (tried, never awaited): while
    its holder has a fenced transaction open (it is still working), `reset` is refused as
    locked (exit 75), and that transaction and the run's completion commit."""
    from airflow_idempotency.runner import RunOutcome

    inside, go = threading.Event(), threading.Event()

    def work(ctx: RunContext) -> dict[str, int]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('holder', %s)", (ctx.run_key,))
            inside.set()
            assert go.wait(30)
        return {}

    holder = Background(lambda: run_in(adv_db, work))
    assert inside.wait(30)
    expire_lease(adv_db, JOB, KEY)
    assert main(["reset", JOB, KEY, "--reason", "stuck", "--dsn", adv_db]) == 75
    go.set()
    assert holder.join().result.outcome is RunOutcome.COMPLETED, chain(holder.error)
    assert written(adv_db) == ["holder"]
    assert rows(adv_db, "SELECT status FROM idempotency.job_runs") == [("completed",)]


def test_a_lease_taken_is_released_when_giving_the_decisions_connection_back_fails(
    adv_db: str,
) -> None:
    """The decision takes the lease and commits; giving its connection back then fails (a
    pool's putconn, a connection's own exit raising). The run fails, and its lease must go with
    it: left, it held the key for its whole time to live (300 s here), every rerun refused as
    locked by a run that no longer exists. Expected: a rerun at once runs the work."""
    calls = 0

    @contextlib.contextmanager
    def connect() -> Iterator[psycopg.Connection[Any]]:
        nonlocal calls
        calls += 1
        with psycopg.connect(adv_db) as conn:
            yield conn
        if calls == 1:  # the decision's connection
            raise RuntimeError("the pool could not take the connection back")

    def work(ctx: RunContext) -> dict[str, int]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('rerun', %s)", (ctx.run_key,))
        return {}

    with pytest.raises(RuntimeError, match="could not take the connection back"):
        run_idempotently(connect=connect, job_name=JOB, run_key=KEY, work=work, lock_mode=LONG)
    assert rows(adv_db, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]
    assert run_in(adv_db, work).outcome.value == "completed"
    assert written(adv_db) == ["rerun"]


@pytest.mark.parametrize("found", ["during the work", "while the completion waits"])
def test_a_completion_whose_lease_is_known_lost_does_not_wait_for_a_slot(
    adv_db: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    found: str,
) -> None:
    """The heartbeat finds the lease lost (another run took the key over) during the work, or
    while the completion waits for a slot the database does not have. The fence would refuse
    the completion anyway: waiting for a slot for the whole lock wait (20 s here) only delays
    the failure, and ends in the sizing rule's error, which names the wrong cause. Expected:
    the run ends at once with LockLostError (the wait says why it stopped), and its work is
    not recorded completed."""
    monkeypatch.setenv("AIRFLOW_IDEMPOTENCY_LOCK_WAIT", "20000")
    working = threading.Event()

    def connect() -> psycopg.Connection[Any]:
        if working.is_set():
            raise psycopg.OperationalError(
                "connection failed: FATAL:  sorry, too many clients already"
            )
        return psycopg.connect(adv_db)

    def work(ctx: RunContext) -> dict[str, int]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('lost', %s)", (ctx.run_key,))
        lost = ctx._lock.lost  # what the heartbeat sets when a renewal finds the lease gone
        assert lost is not None
        if found == "during the work":
            lost.set()
        else:
            threading.Timer(1.0, lost.set).start()
        working.set()
        return {}

    began = time.monotonic()
    with pytest.raises(LockLostError):
        run_idempotently(connect=connect, job_name=JOB, run_key=KEY, work=work, lock_mode=LONG)
    assert time.monotonic() - began < 6
    status = rows(adv_db, "SELECT status FROM idempotency.job_runs")
    assert status == [("started",)], status
    if found != "during the work":
        said = [r.getMessage() for r in caplog.records]
        assert any("stopped waiting" in m and "lease lost" in m for m in said), said


def test_a_completion_committed_then_lost_is_completed_though_the_heartbeat_saw_the_lease_go(
    adv_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion's COMMIT lands (it releases the lease), then its connection is lost
    before the reply; the heartbeat's next renewal finds the lease gone and marks it lost. The
    try again is refused before it connects (the lease is known lost), and the attempt's
    recorded outcome must then be read: it says completed, though the database has no slot for
    a second (its connections are all taken for a moment). Found: the read-back waited for its
    connection with the completion's ``hopeless`` (the lease known lost), so it stopped at the
    first refusal, never read, and the run reported LockLostError for a run it had completed."""
    full_until = [0.0]

    def connect() -> psycopg.Connection[Any]:
        if time.monotonic() < full_until[0]:
            raise psycopg.OperationalError(
                "connection failed: FATAL:  sorry, too many clients already"
            )
        return psycopg.connect(adv_db)

    def then(run: Any) -> None:
        run._taken.lost.set()  # what the heartbeat's next renewal does: the lease is gone
        full_until[0] = time.monotonic() + 1.0  # and the database is full for a second

    tries = lose_first_completion(monkeypatch, then)

    def work(ctx: RunContext) -> dict[str, int]:
        with ctx.transaction() as cur:
            cur.execute("INSERT INTO public.facts VALUES ('once', %s)", (ctx.run_key,))
        return {"facts": 1}

    result = run_idempotently(connect=connect, job_name=JOB, run_key=KEY, work=work, lock_mode=LONG)
    assert result.outcome.value == "completed"
    assert tries == [True], tries
    attempts = rows(adv_db, "SELECT outcome, error FROM idempotency.job_run_attempts")
    assert attempts == [("completed", None)], attempts
    assert rows(adv_db, "SELECT status FROM idempotency.job_runs") == [("completed",)]
