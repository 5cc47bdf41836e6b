"""Lock loss with takeover: worker A loses its lock mid-export, worker B finishes the date.

Worker A (a real ``airflow dags test`` of finalize_invoices) pauses inside the export at a
fault point. The test then terminates A's lock session (``pg_terminate_backend`` of the
backend that holds the export's run lock, read through held_run_locks()) and freezes A with
SIGSTOP, like a long GC pause or a VM migration, so that worker B is sure to take the
key over and run the date to completion while A is paused. Then A resumes.

A must not send one more request, must not mark anything completed, and its task try must
fail; its Airflow retry then finds the date completed and does nothing. The final state
must be that of an uninterrupted run: one remote invoice per order, every ledger row
confirmed with the remote's reference.

The first scenario runs in the lease mode too (id ``[lease]``: the job connection's extra
``lock_mode: lease``): A holds no session to terminate, so its lease is taken over instead
(expired, a new token: support.locks.terminate_lock_session), as a successor does after A's
heartbeat stopped for the lease's time to live. The in-process tests below stay in the
advisory mode: they prove that the ledger sees an ENDED LOCK SESSION at once, before each call,
without a round trip. A lease has no such session: its loss is seen by the ledger's database
check (every ``lock_check_interval``, 0.5 s) or the heartbeat, so "no call begins after the
loss" is bounded by that interval there, not immediate (tests/faults/test_faults_fence.py and
tests/integration cover the lease mode's fenced writes).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from airflow_idempotency import Effect, post_json
from airflow_idempotency.ledger.senders import Confirmation, EffectSender
from support.db import rows
from support.faults import (
    NO_PROBLEMS,
    D,
    Watched,
    check_consistency,
    connection_env,
    figures,
    final_state,
    finish,
    kill_group,
    lock_extra,
    lock_modes_used,
    refusal,
    service_counts,
    spawn_worker,
)
from support.locks import advisory_locks, terminate_lock_session

ORDERS = 60
BATCH = 10
EXPORT_JOB = "finalize_invoices.export_invoices"


def export_attempts(dsn: str) -> list[tuple[int, int, str]]:
    """(attempt_id, OS pid of the worker, outcome) of the export job, in order."""
    return [
        (int(a), int(p), o)
        for a, p, o in rows(
            dsn,
            "SELECT attempt_id, pid, outcome FROM idempotency.job_run_attempts"
            " WHERE job_name = %s ORDER BY attempt_id",
            (EXPORT_JOB,),
        )
    ]


def ledger(dsn: str) -> list[tuple[str, str, int, int, str | None]]:
    return rows(
        dsn,
        "SELECT idempotency_key, status, call_count, last_attempt_id, last_error"
        " FROM idempotency.outbound_ledger ORDER BY idempotency_key",
    )


def takeover(
    invoicing: Any, airflow_home: Path, tmp_path: Path, pause_at: str, lock_mode: str = "advisory"
) -> dict[str, Any]:
    """Run the scenario with A paused at ``pause_at``, the runs in ``lock_mode``; return what
    each side did."""
    invoicing.seed(D, orders=ORDERS)
    extra = lock_extra(lock_mode)
    env = connection_env(invoicing.dsn, invoicing.service.url, job_extra=extra, batch_size=BATCH)
    a = Watched(
        spawn_worker(
            airflow_home,
            tmp_path / "worker-a",
            invoicing.dsn,
            {**env, "AIRFLOW_IDEMPOTENCY_SLEEP_AT": f"{pause_at}=12"},
        )
    )
    try:
        a.wait_for(f"fault point {pause_at}: ")  # "sleeping Ns" or "pausing (N)"
        lock_pid = terminate_lock_session(invoicing.dsn, EXPORT_JOB, D)
        os.killpg(a.proc.pid, signal.SIGSTOP)  # A stays paused until B is done
        try:
            before_b = service_counts(invoicing.service)
            ledger_before_b = ledger(invoicing.dsn)
            b_code, b_out, b_seconds = finish(
                spawn_worker(airflow_home, tmp_path / "worker-b", invoicing.dsn, env)
            )
            after_b = service_counts(invoicing.service)
            ledger_after_b = ledger(invoicing.dsn)
        finally:
            os.killpg(a.proc.pid, signal.SIGCONT)
        a_code, a_out = a.finish()
    finally:
        kill_group(a.proc)  # also when it is still stopped: SIGKILL ends a stopped process
    return {
        "lock_pid": lock_pid,
        "a_pid": a.proc.pid,
        "a_code": a_code,
        "a_out": a_out,
        "b_code": b_code,
        "b_out": b_out,
        "b_seconds": b_seconds,
        "before_b": before_b,
        "after_b": after_b,
        "after_a": service_counts(invoicing.service),
        "ledger_before_b": ledger_before_b,
        "ledger_after_b": ledger_after_b,
        "ledger_final": ledger(invoicing.dsn),
        "attempts": export_attempts(invoicing.dsn),
        "modes": lock_modes_used(invoicing.dsn),
    }


def assert_a_lost_and_b_won(out: dict[str, Any], dsn: str) -> None:
    """The parts both scenarios share: B completed, A failed its try, final state clean."""
    assert out["b_code"] == 0, out["b_out"][-4000:]
    # A's try failed on the lost lock, and its retry found the date completed.
    assert "LockLostError" in out["a_out"], out["a_out"][-4000:]
    assert out["a_code"] == 0, out["a_out"][-4000:]
    attempts = out["attempts"]
    a_attempts = [(aid, outcome) for aid, pid, outcome in attempts if pid == out["a_pid"]]
    b_attempts = [(aid, outcome) for aid, pid, outcome in attempts if pid != out["a_pid"]]
    assert [o for _, o in b_attempts] == ["completed"]
    assert a_attempts[0][1] == "lock_lost"  # the attempt that lost its lock never completes
    assert [o for _, o in a_attempts[1:]] == ["noop"]
    assert rows(
        dsn,
        "SELECT status, current_attempt_id FROM idempotency.job_runs WHERE job_name = %s",
        (EXPORT_JOB,),
    ) == [("completed", b_attempts[0][0])]
    # The final state is that of a clean run.
    state = final_state(dsn)
    assert len(state["invoices"]) == ORDERS and state["uninvoiced_orders"] == 0
    assert len(state["remote"]) == ORDERS
    assert [status for _, status in state["ledger"]] == ["succeeded"] * ORDERS
    assert set(state["jobs"].values()) == {"completed"}
    assert check_consistency(dsn) == NO_PROBLEMS
    assert advisory_locks(dsn) == 0


@pytest.mark.slow
@pytest.mark.both_airflow_lines
@pytest.mark.parametrize("lock_mode", ["advisory", "lease"])
def test_paused_before_its_first_call_a_sends_nothing_after_losing_the_lock(
    invoicing: Any, airflow_home: Path, tmp_path: Path, lock_mode: str
) -> None:
    """A worker whose lock session is terminated (its lease taken over) while it is paused before its first export call sends nothing afterwards, never completes, and B's takeover converges."""
    out = takeover(invoicing, airflow_home, tmp_path, "ledger.before_remote_call", lock_mode)
    assert out["modes"] == {lock_mode}
    assert (out["lock_pid"] == 0) == (lock_mode == "lease")  # a lease: taken over
    a_first = min(aid for aid, pid, _ in out["attempts"] if pid == out["a_pid"])
    figures(
        f"A paused with its first batch claimed; B took over in {out['b_seconds']:.1f}s and sent "
        f"{out['after_b']['requests'] - out['before_b']['requests']} requests; A sent "
        f"{out['after_a']['requests'] - out['after_b']['requests']} after resuming; "
        f"export attempts {[((pid == out['a_pid'] and 'A') or 'B', o) for _, pid, o in out['attempts']]};"
        f" confirmed rows A's lost attempt wrote to afterwards: "
        f"{sum(1 for _, _, _, last, _ in out['ledger_final'] if last == a_first)} "
        f"(last_error {sorted({e for _, _, _, last, e in out['ledger_final'] if last == a_first})})"
    )
    # Nothing had been sent when A paused: its first batch was claimed, not called.
    assert out["before_b"]["requests"] == 0
    assert [(s, c) for _, s, c, _, _ in out["ledger_before_b"]] == [("pending", 0)] * BATCH
    # B sent each order once; A, resumed after B had finished, sent nothing at all.
    assert out["after_b"]["requests"] == ORDERS
    assert out["after_a"]["requests"] == ORDERS
    assert out["after_a"]["invoices"] == ORDERS and out["after_a"]["replays"] == 0
    # Every ledger row was called exactly once, by B, and names B's attempt without error
    # (A's late "not sent" outcomes for its claimed batch left B's confirmations alone).
    b_attempt = next(aid for aid, pid, o in out["attempts"] if pid != out["a_pid"])
    assert [(c, last, err) for _, _, c, last, err in out["ledger_final"]] == [
        (1, b_attempt, None)
    ] * ORDERS
    assert_a_lost_and_b_won(out, invoicing.dsn)


@pytest.mark.slow
@pytest.mark.both_airflow_lines
def test_paused_with_a_batch_in_hand_a_records_its_confirmations_then_stops(
    invoicing: Any, airflow_home: Path, tmp_path: Path
) -> None:
    """A worker that loses its lock after its first batch was confirmed remotely but not yet recorded records those facts harmlessly and claims no further batch."""
    out = takeover(invoicing, airflow_home, tmp_path, "ledger.before_record_outcomes")
    assert out["modes"] == {"advisory"}
    a_sent_before = out["before_b"]["requests"]
    figures(
        f"A had sent {a_sent_before} calls when paused; B sent "
        f"{out['after_b']['requests'] - a_sent_before} requests "
        f"({out['after_b']['replays']} replays); A sent "
        f"{out['after_a']['requests'] - out['after_b']['requests']} after resuming"
    )
    # A had sent its first batch (confirmed by the service, not yet in the ledger).
    assert a_sent_before == BATCH and out["before_b"]["invoices"] == BATCH
    # B resent those pending keys with the same keys (replayed, no new invoice) and the rest once.
    assert out["after_b"]["requests"] - a_sent_before == ORDERS
    assert out["after_b"]["replays"] == BATCH
    assert out["after_b"]["invoices"] == ORDERS
    # A, resumed, sent nothing more: its next claim was fenced.
    assert out["after_a"]["requests"] == out["after_b"]["requests"]
    # A's first batch: called by A (confirmed, recorded late) and by B (replayed); every
    # other row once, by B. No row carries an error.
    a_first = min(aid for aid, pid, _ in out["attempts"] if pid == out["a_pid"])
    b_attempt = next(aid for aid, pid, o in out["attempts"] if pid != out["a_pid"])
    final = out["ledger_final"]
    assert sorted(c for _, _, c, _, _ in final) == [1] * (ORDERS - BATCH) + [2] * BATCH
    assert {last for _, _, c, last, _ in final if c == 1} == {b_attempt}
    assert {last for _, _, c, last, _ in final if c == 2} <= {a_first, b_attempt}
    assert {err for *_, err in final} == {None}
    assert_a_lost_and_b_won(out, invoicing.dsn)
    assert "lost" in out["a_out"]


# -- bugs the scenarios above uncovered (fixed in 70ef64c), reduced to fast regression tests


def test_a_failure_after_the_lock_session_died_is_recorded(pg_dsn: str) -> None:
    """When the lock session was terminated and the work then fails, the attempt is recorded as lock_lost and the run as failed, not left running."""
    import psycopg

    from airflow_idempotency.exceptions import LockLostError
    from airflow_idempotency.runner import run_idempotently

    def work(run: Any) -> None:
        terminate_lock_session(pg_dsn, "j", "k")
        with run.transaction() as cur:  # the fencing check refuses this commit
            cur.execute("SELECT 1")

    with pytest.raises(LockLostError) as lost:
        run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn), job_name="j", run_key="k", work=work
        )
    assert rows(pg_dsn, "SELECT outcome FROM idempotency.job_run_attempts") == [("lock_lost",)]
    assert rows(pg_dsn, "SELECT status FROM idempotency.job_runs") == [("failed",)]
    figures(f"{refusal(lost.value)}; attempt recorded lock_lost, run failed")


def test_a_lost_attempt_does_not_rewrite_rows_its_successor_confirmed(
    pg_dsn: str, accounting: Any
) -> None:
    """Outcomes recorded late by an attempt that lost its lock leave the successor's confirmed rows naming the successor, with no error."""
    import threading

    import psycopg

    from airflow_idempotency import Effect, OutboundLedger, Retries, post_json
    from airflow_idempotency.exceptions import LockLostError, TransientRemoteError
    from airflow_idempotency.runner import run_idempotently

    effects = [Effect(f"job:k:order_{i}", {"order_id": i}) for i in (1, 2)]
    post = post_json("/api/invoices")
    attempt_ids: dict[str, int] = {}

    def connect() -> Any:
        return psycopg.connect(pg_dsn)

    def successor() -> None:
        def work(run: Any) -> None:
            attempt_ids["B"] = run.attempt_id
            OutboundLedger(run, "accounting").send_all(effects, post, base_url=accounting.url)

        run_idempotently(connect=connect, job_name="job", run_key="k", work=work)

    async def first_call_loses_the_lock(client: Any, effect: Effect) -> Any:
        if "B" not in attempt_ids:
            terminate_lock_session(pg_dsn, "job", "k")
            takeover = threading.Thread(target=successor)
            takeover.start()
            takeover.join(60)  # B confirms both effects while A's call is "in flight"
            raise TransientRemoteError("simulated 503: A's answer was lost")
        return await post(client, effect)

    def work(run: Any) -> None:
        attempt_ids["A"] = run.attempt_id
        ledger = OutboundLedger(
            run,
            "accounting",
            concurrency=1,
            lock_check_interval=0,
            retries=Retries(backoff_initial=0.01),
        )
        ledger.send_all(effects, first_call_loses_the_lock, base_url=accounting.url)

    with pytest.raises(LockLostError) as lost:
        run_idempotently(connect=connect, job_name="job", run_key="k", work=work)
    assert accounting.stats()["invoices"] == 2
    assert rows(
        pg_dsn,
        "SELECT idempotency_key, status, last_attempt_id, last_error"
        " FROM idempotency.outbound_ledger ORDER BY idempotency_key",
    ) == [(e.idempotency_key, "succeeded", attempt_ids["B"], None) for e in effects]
    figures(
        f"attempt {attempt_ids['A']} lost its lock mid-call and ended with {type(lost.value).__name__};"
        f" attempt {attempt_ids['B']} confirmed 2 of 2 effects and still names them; 2 invoices"
        " at the remote"
    )


# -- the ledger stops calling at once when its lock session ends mid-export (issue 30) ------

LOSS_AT_CALL = 3  # the lock session is ended at the start of this call


def terminate_every_session(dsn: str) -> int:
    """End every other session of the database at once, as a writer failover does, and wait
    until they are gone; return how many."""
    ended = rows(
        dsn,
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    return int(ended[0][0])


class _LosesTheLockAtCall(EffectSender[Any]):
    """The example's JSON POST to the accounting service, deduplicating or not, which ends
    the run's lock session (``everything``: every session of the database) and waits until
    it is gone, when its LOSS_AT_CALL-th call begins, and counts the calls that begin after
    that."""

    def __init__(
        self, dsn: str, url: str, *, deduplicating: bool, everything: bool = False
    ) -> None:
        self.everything = everything
        from airflow_idempotency.ledger.http import HttpSender

        self.http = HttpSender(url, post_json("/api/invoices"))
        self.dsn = dsn
        self.deduplicating = deduplicating
        self.kind = "http"
        self.target = url
        self.begun = 0
        self.after_loss = 0
        self.lost = False
        self._count = threading.Lock()

    async def connect(self) -> Any:
        return await self.http.connect()

    async def disconnect(self, connection: Any) -> None:
        await self.http.disconnect(connection)

    async def send(self, connection: Any, effect: Effect) -> Confirmation:
        with self._count:
            self.begun += 1
            self.after_loss += self.lost
            end_it = self.begun == LOSS_AT_CALL
        if end_it:
            if self.everything:
                terminate_every_session(self.dsn)
            else:
                terminate_lock_session(self.dsn, "job", "2026-10-01")
            self.lost = True
        return await self.http.send(connection, effect)


@pytest.mark.parametrize(
    ("count", "concurrency", "deduplicating"),
    [(10, 16, True), (200, 16, True), (200, 4, True), (60, 4, False)],
    ids=["10-dedup", "200-dedup", "200-dedup-c4", "60-not-dedup"],
)
def test_no_call_begins_after_the_lock_session_ended(
    pg_dsn: str, accounting: Any, count: int, concurrency: int, deduplicating: bool
) -> None:
    """Once the run's lock session has ended mid-export, no further call reaches the remote: the ledger sees the ended session before each call (its socket, no round trip), records what it sent, and the try ends with LockLostError."""
    import psycopg

    from airflow_idempotency import OutboundLedger, RunOptions, run_idempotently
    from airflow_idempotency.exceptions import LockLostError

    sender = _LosesTheLockAtCall(pg_dsn, accounting.url, deduplicating=deduplicating)
    items = [Effect(f"job:k:order_{i}", {"order_id": i}) for i in range(count)]

    def work(run: Any) -> None:
        OutboundLedger(run, "accounting", concurrency=concurrency).send_all(items, sender)

    with pytest.raises(LockLostError) as lost:
        run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn),
            job_name="job",
            run_key="2026-10-01",
            work=work,
            options=RunOptions(),
        )
    requests = accounting.stats()["requests"]
    statuses = dict(
        rows(pg_dsn, "SELECT status, count(*) FROM idempotency.outbound_ledger GROUP BY 1")
    )
    figures(
        f"{count} effects, concurrency {concurrency}, "
        f"{'deduplicating' if deduplicating else 'not deduplicating'}: lock session ended at "
        f"call {LOSS_AT_CALL}; {sender.after_loss} call(s) began after it, {requests} reached "
        f"the service; ledger {statuses}; {type(lost.value).__name__}"
    )
    assert sender.after_loss == 0
    assert requests == sender.begun == LOSS_AT_CALL
    assert statuses.get("succeeded", 0) == LOSS_AT_CALL  # what was sent is recorded
    assert rows(pg_dsn, "SELECT outcome FROM idempotency.job_run_attempts") == [("lock_lost",)]


@pytest.mark.parametrize("deduplicating", [True, False], ids=["dedup", "not-dedup"])
def test_every_session_ended_at_once_mid_export_ends_lock_lost_and_the_rerun_converges(
    pg_dsn: str, accounting: Any, deduplicating: bool
) -> None:
    """A writer failover mid-export (every session of the database terminated at once): the attempt ends lock_lost with LockLostError saying what happened, never a raw psycopg AdminShutdown; the rerun sends the rest and the remote acts once per effect."""
    import psycopg

    from airflow_idempotency import OutboundLedger, RunOptions, run_idempotently
    from airflow_idempotency.exceptions import LockLostError

    count = 40
    items = [Effect(f"job:k:order_{i}", {"order_id": i}) for i in range(count)]
    failing = _LosesTheLockAtCall(
        pg_dsn, accounting.url, deduplicating=deduplicating, everything=True
    )

    def run(sender: Any) -> Any:
        def work(run: Any) -> None:
            run.connection.execute("SELECT 1")
            OutboundLedger(run, "accounting", concurrency=4, batch_size=10).send_all(items, sender)
            run.connection.execute("SELECT 1")  # the work's own connection, ended too

        return run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn),
            job_name="job",
            run_key="2026-10-01",
            work=work,
            options=RunOptions(),
        )

    with pytest.raises(LockLostError) as lost:
        run(failing)
    assert not isinstance(lost.value, psycopg.Error)
    first = rows(pg_dsn, "SELECT outcome, error FROM idempotency.job_run_attempts")
    assert [o for o, _ in first] == ["lock_lost"]
    assert "AdminShutdown" not in str(first[0][1]).split(":")[0]
    # The rerun: unknown keys (a remote that does not deduplicate) wait for an operator.
    unknown = [k for (k,) in rows(
        pg_dsn, "SELECT idempotency_key FROM idempotency.outbound_ledger WHERE status = 'unknown'"
    )]  # fmt: skip
    plain = _LosesTheLockAtCall(pg_dsn, accounting.url, deduplicating=deduplicating)
    plain.begun = -(10**6)  # never ends anything
    if unknown:
        from airflow_idempotency.exceptions import EffectsUnknownError

        with pytest.raises(EffectsUnknownError):
            run(plain)
    else:
        run(plain)
    stats = accounting.stats()
    statuses = dict(
        rows(pg_dsn, "SELECT status, count(*) FROM idempotency.outbound_ledger GROUP BY 1")
    )
    figures(
        f"{'deduplicating' if deduplicating else 'not deduplicating'}: every session ended at "
        f"call {LOSS_AT_CALL} of {count}; {failing.after_loss} call(s) began after it; "
        f"{refusal(lost.value)}; rerun: ledger {statuses}, {stats['invoices']} invoices at the "
        f"service for {count} effects ({stats['replays']} replays)"
    )
    assert failing.after_loss == 0
    # Once each at most (no order invoiced twice); unknown ones were not resent.
    assert count - len(unknown) <= stats["invoices"] <= count
    assert statuses == {
        "succeeded": count - len(unknown),
        **({"unknown": len(unknown)} if unknown else {}),
    }
