"""The fence under a lost lock, where transactions nest: nothing hangs, nothing commits late.

Worker A's lock session is terminated (``pg_terminate_backend``, as a network cut or an
operator would) while A is inside ``run.transaction()``; worker B takes the key over. A then
uses the outbound ledger inside that open transaction (issue 30, defect 1: both hung for
ever), or keeps the transaction open while its worker does something else (B's takeover
then waits a bounded time and names A's session). Both are real runs in threads of this
process against a real PostgreSQL, in both lock modes (the ``lock_mode`` fixture: in the lease
mode A's lease expires instead).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_idempotency.effects.outputs import OutputFile
from airflow_idempotency.exceptions import LockLostError, LockWaitError
from airflow_idempotency.ledger import OutboundLedger
from airflow_idempotency.ledger.senders import Effect
from airflow_idempotency.locks import LOCK_WAIT_ENV
from airflow_idempotency.runner import RunContext, RunOutcome, RunResult, run_idempotently
from support.db import rows
from support.faults import figures
from support.fenced_work import FENCE_KEYS, Recorder, insert, outcomes, writer, written
from support.locks import Background, terminate_lock_session, wait_for, waiting_backends

JOB, KEY = "fenced_export", "2026-10-01"


def run(dsn: str, work: Callable[[RunContext], Any], **connect: Any) -> RunResult:
    return run_idempotently(
        connect=lambda: psycopg.connect(dsn, **connect), job_name=JOB, run_key=KEY, work=work
    )


def send_through_the_ledger(ctx: RunContext, remote: Recorder, folder: Path) -> None:
    OutboundLedger(ctx, "remote").send_all([Effect("k1", {"n": 1})], remote)


def write_an_output_file(ctx: RunContext, remote: Recorder, folder: Path) -> None:
    with OutputFile(ctx, "export.csv", root=folder) as output:
        output.write_text("old")


@pytest.mark.parametrize("effect", [send_through_the_ledger, write_an_output_file])
def test_an_effect_inside_a_lost_attempts_transaction_fails_at_once(
    facts: str,
    tmp_path: Path,
    effect: Callable[[RunContext, Recorder, Path], None],
    lock_mode: str,
) -> None:
    """Defect 1: an attempt whose lock session ended while its run.transaction() is open, and
    which then uses the ledger (or an OutputFile) inside it while a successor's takeover waits for that
    transaction: the ledger's claim is refused at once (it never queues behind the takeover),
    nothing is called, and the successor then completes. Before the fix both hung for ever."""
    inside, go = threading.Event(), threading.Event()
    remote = Recorder()

    def old_work(ctx: RunContext) -> None:
        with ctx.transaction() as cur:
            insert(cur, "old")
            inside.set()
            assert go.wait(30)
            effect(ctx, remote, tmp_path)

    old = Background(lambda: run(facts, old_work))
    assert inside.wait(30)
    terminate_lock_session(facts, JOB, KEY)
    new = Background(lambda: run(facts, writer("new")))
    wait_for("the successor's takeover to wait", lambda: bool(waiting_backends(facts, FENCE_KEYS)))
    went = time.monotonic()
    go.set()
    assert isinstance(old.join(20).error, LockLostError), old.error
    refused_in = time.monotonic() - went
    assert new.join(20).error is None and new.result.outcome is RunOutcome.COMPLETED
    assert remote.calls == [] and not (tmp_path / "export.csv").exists()
    assert written(facts) == ["new"]
    assert outcomes(facts) == ["lock_lost", "completed"]
    figures(
        f"A's ledger claim refused {refused_in * 1000:.0f} ms after A resumed; B completed, "
        f"{len(remote.calls)} call(s) reached the remote; attempts {outcomes(facts)}"
    )


def test_a_takeover_waits_a_bounded_time_and_names_the_open_transaction(
    facts: str, monkeypatch: pytest.MonkeyPatch, lock_mode: str
) -> None:
    """A successor whose takeover waits for a transaction the lost attempt keeps open (its
    worker busy outside the database) gives up after the bound (1 s here) with an error that
    names the old backend's pid and application_name and what to do; its attempt is recorded
    failed. The old transaction never commits."""
    monkeypatch.setenv(LOCK_WAIT_ENV, "1")
    inside, go = threading.Event(), threading.Event()
    pids: list[int] = []

    def old_work(ctx: RunContext) -> None:
        with ctx.transaction() as cur:
            insert(cur, "old")
            pids.append(ctx.connection.info.backend_pid)
            inside.set()
            assert go.wait(30)

    old = Background(lambda: run(facts, old_work, application_name="old-worker"))
    assert inside.wait(30)
    terminate_lock_session(facts, JOB, KEY)
    began = time.monotonic()
    with pytest.raises(LockWaitError) as waited:
        run(facts, writer("new"))
    gave_up_in = time.monotonic() - began
    message = str(waited.value)
    assert f"backend pid {pids[0]}" in message and "'old-worker'" in message
    assert "pg_terminate_backend" in message
    go.set()
    assert isinstance(old.join(20).error, LockLostError)
    assert written(facts) == []
    assert outcomes(facts) == ["lock_lost", "failed"]
    ((error,),) = rows(facts, "SELECT error FROM idempotency.job_run_attempts WHERE attempt_id = 2")
    assert f"backend pid {pids[0]}" in error
    assert run(facts, writer("rerun")).outcome is RunOutcome.COMPLETED
    figures(
        f"B's takeover gave up after {gave_up_in:.2f} s (bound 1 s), naming backend pid "
        f"{pids[0]} 'old-worker'; attempts then {outcomes(facts)}"
    )
