"""The example's invariants (devtools/invariants.sql) and its witnesses, on a real PostgreSQL.

Each history invariant is shown a constructed history that breaks it and the clean history
next to it; the witnesses are shown to count what really ran (the example's tasks run by
the provider, without Airflow).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_idempotency.runner import RunOptions, run_idempotently
from airflow_idempotency.schema import ensure_schema
from devtools import invariants
from devtools.invariants import INVARIANTS, Checker, fire_time

D = "2026-10-01"
T0 = dt.datetime(2026, 10, 2, 1, 0, tzinfo=dt.timezone.utc)
JOB = "finalize_invoices.create_invoices"
ALWAYS: tuple[invariants.When, ...] = ("always",)
PLAIN = RunOptions()


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


@pytest.fixture
def job_db(pg_dsn: str) -> Iterator[str]:
    """A job database with the provider's, the example's and the accounting service's
    tables, and chaos's table of lock losses."""
    from accounting_service.store import ensure_schema as ensure_accounting_schema
    from invoicing.seed import seed_orders

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        ensure_schema(conn)
        seed_orders(conn, dt.date(2026, 10, 1), dt.date(2026, 10, 1), 5, 7)
    asyncio.run(ensure_accounting_schema(pg_dsn))
    invariants.prepare(pg_dsn)
    yield pg_dsn


class History:
    """Writes a constructed history: attempts, witness rows, lock losses, ledger, remote."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)

    def attempt(
        self,
        attempt_id: int,
        outcome: str,
        started: float,
        *,
        force: bool = False,
        dry_run: bool = False,
        job: str = JOB,
        lock_pid: int | None = 100,  # None: the lease mode (no lock session)
        lock_key: int = 42,
    ) -> None:
        self.conn.execute(
            "INSERT INTO idempotency.job_run_attempts (attempt_id, job_name, run_key, lock_key,"
            " outcome, triggered_by, hostname, pid, lock_backend_pid, force, dry_run, started_at)"
            " OVERRIDING SYSTEM VALUE VALUES (%s, %s, %s, %s, %s, 'manual', 'h', 1, %s, %s, %s, %s)",
            (attempt_id, job, D, lock_key, outcome, lock_pid, force, dry_run, at(started)),
        )

    def work(
        self,
        attempt_id: int,
        began: float,
        committed: float,
        *,
        forced: bool = False,
        job: str = JOB,
    ) -> None:
        """A committed work transaction of ``attempt_id`` from ``began`` to ``committed``."""
        witness_id = self.conn.execute(
            "INSERT INTO work_witness (attempt_id, job_name, run_key, forced, work)"
            " VALUES (%s, %s, %s, %s, 'create_invoices') RETURNING witness_id",
            (attempt_id, job, D, forced),
        ).fetchone()
        assert witness_id is not None
        self.conn.execute(  # the trigger set the real commit time: move it to the story's
            "UPDATE work_witness SET began_at = %s, committed_at = %s WHERE witness_id = %s",
            (at(began), at(committed), witness_id[0]),
        )

    def lock_lost(self, pid: int, lock_key: int, backend_start: float, gone: float) -> None:
        times = {"backend_start": at(backend_start), "terminated_at": at(gone - 0.1)}
        params = {"pid": pid, "lock_key": lock_key, "gone_at": at(gone), **times}
        self.conn.execute(invariants.queries()["record_lock_loss"], params)

    def lease_lost(self, attempt_id: int, lock_key: int, token: int, taken_over: float) -> None:
        """Chaos took the lease ``token`` of ``attempt_id`` over at ``taken_over``."""
        self.conn.execute(
            "INSERT INTO witness_lease_losses (lock_key, token, attempt_id, taken_over_at)"
            " VALUES (%s, %s, %s, %s)",
            (lock_key, token, attempt_id, at(taken_over)),
        )

    def confirmed(self, key: str, confirmed: float) -> None:
        self.conn.execute(
            "INSERT INTO idempotency.outbound_ledger (remote_system, idempotency_key, job_name,"
            " run_key, request_fingerprint, status, remote_reference, confirmed_at)"
            " VALUES ('accounting', %s, 'finalize_invoices.export_invoices', %s, 'f',"
            " 'succeeded', 'ACC-000001', %s)",
            (key, D, at(confirmed)),
        )

    def request(self, key: str, received: float, outcome: str = "replayed") -> None:
        self.conn.execute(
            "INSERT INTO accounting.requests (idempotency_key, received_at, outcome, instance_id)"
            " VALUES (%s, %s, %s, 'test')",
            (key, at(received), outcome),
        )

    def remote_invoice(self, key: str, order_id: int) -> None:
        self.conn.execute(
            "INSERT INTO accounting.invoices (idempotency_key, request_hash, invoice)"
            " VALUES (%s, 'h', json_build_object('order_id', %s::text, 'business_date', %s::text))",
            (key, order_id, D),
        )

    def violated(self) -> set[str]:
        return {v.invariant.name for v in invariants.check(self.conn, [D], ALWAYS)}


@pytest.fixture
def history(job_db: str) -> Iterator[History]:
    made = History(job_db)
    try:
        yield made
    finally:
        made.conn.close()


RECOMPUTE_WITNESSED = "at most one completed execution per key unless forced (witness)"
RECOMPUTE_RECORDED = "completed key never recomputed without force (attempt records)"
OVERLAP = "no two attempts' work transactions of one key overlap"
AFTER_LOCK_LOST = "no commit after the lock was lost"
AFTER_SUCCESSOR = "no commit after a later attempt of the key started"
RESENT = "a confirmed effect never reaches the remote again"


def test_every_invariant_has_its_query() -> None:
    """Each invariant names a query of invariants.sql, and no two invariants share a name."""
    names = [i.name for i in INVARIANTS]
    assert len(set(names)) == len(names)
    assert {i.query for i in INVARIANTS} <= set(invariants.queries())


def test_a_clean_history_breaks_nothing(history: History) -> None:
    """One attempt that worked and completed, a no-op, a forced recompute, a dry run, a
    lock lost by an attempt that then committed nothing: no invariant is violated."""
    history.attempt(1, "completed", 0)
    history.work(1, 1, 2)
    history.attempt(2, "noop", 3)
    history.attempt(3, "completed", 4, force=True, lock_pid=101)
    history.work(3, 5, 6, forced=True)
    history.attempt(4, "dry_run", 7, dry_run=True)
    history.attempt(5, "lock_lost", 8, force=True, lock_pid=102, lock_key=43)
    history.lock_lost(102, 43, backend_start=7.5, gone=9)
    history.confirmed("finalize_invoices:2026-10-01:order_1", 10)
    history.request("finalize_invoices:2026-10-01:order_1", 9.5, "created")
    history.remote_invoice("finalize_invoices:2026-10-01:order_1", 1)
    assert history.violated() == set()


@pytest.mark.parametrize(
    ("story", "expected"),
    [
        # A completed key done again without force.
        ([(1, "completed", False), (2, "completed", False)], {2}),
        # A forced recompute crashed (abandoned, lock_lost): a plain run finishes it ...
        ([(1, "completed", False), (2, "lock_lost", True), (3, "completed", False)], set()),
        # ... but only once: after that completion a plain run must no-op again.
        (
            [
                (1, "completed", False),
                (2, "failed", True),
                (3, "completed", False),
                (4, "completed", False),
            ],
            {4},
        ),
        # Running now, after a completion, not forced.
        ([(1, "completed", False), (2, "running", False)], {2}),
        # A dry run is no recompute.
        ([(1, "completed", False), (2, "dry_run", False), (3, "completed", True)], set()),
    ],
)
def test_recompute_without_force_is_caught_by_the_witness_and_the_records(
    history: History, story: list[tuple[int, str, bool]], expected: set[int]
) -> None:
    """A plain attempt may redo a completed key only to finish a forced recompute that
    did not complete; both the witness rows and the provider's records say which."""
    for attempt_id, outcome, force in story:
        dry = outcome == "dry_run"
        history.attempt(attempt_id, outcome, attempt_id * 10, force=force, dry_run=dry)
        if not dry:
            history.work(attempt_id, attempt_id * 10 + 1, attempt_id * 10 + 2, forced=force)
    for seen_by in ("witness", "records"):
        params = {"keys": [D], "seen_by": seen_by}
        flagged = invariants.dict_rows(history.conn, "recomputed_without_force", params)
        assert {r["attempt_id"] for r in flagged} == expected, seen_by


def test_witness_counts_executions_the_records_do_not_show(history: History) -> None:
    """A second execution the provider recorded as a no-op (a broken build would) still
    shows in the witness: the witness invariant fails, the records one cannot see it."""
    history.attempt(1, "completed", 0)
    history.work(1, 1, 2)
    history.attempt(2, "noop", 3)
    history.work(2, 3.5, 4)
    violated = history.violated()
    assert RECOMPUTE_WITNESSED in violated and RECOMPUTE_RECORDED not in violated


def test_overlapping_work_of_two_attempts_is_caught(history: History) -> None:
    """Two attempts' work transactions of one key that overlap in time (the lock excluded
    no one) are caught; back-to-back ones are not."""
    history.attempt(1, "lock_lost", 0)
    history.attempt(2, "completed", 1, lock_pid=101, lock_key=43)
    history.work(1, 1, 5)
    history.work(2, 4, 6)
    assert OVERLAP in history.violated()
    history.conn.execute("UPDATE work_witness SET began_at = %s WHERE attempt_id = 2", (at(5.5),))
    assert OVERLAP not in history.violated()


def test_commit_after_the_lock_session_was_gone_is_caught(history: History) -> None:
    """Work committed by an attempt after chaos saw its lock session gone is caught; a
    commit before that instant, or by another session's attempt, is not."""
    history.attempt(1, "lock_lost", 10, lock_pid=100, lock_key=42)
    history.lock_lost(100, 42, backend_start=9, gone=12)
    history.work(1, 11, 11.5)
    assert AFTER_LOCK_LOST not in history.violated()
    history.work(1, 11.8, 12.5)
    assert AFTER_LOCK_LOST in history.violated()
    # The same pid and key before that session started: another session, not this loss.
    history.conn.execute("UPDATE idempotency.job_run_attempts SET started_at = %s", (at(8),))
    assert AFTER_LOCK_LOST not in history.violated()


def test_commit_after_the_lease_was_taken_over_is_caught(history: History) -> None:
    """The lease mode: work committed by an attempt after chaos took its lease over is
    caught; a commit before that instant, or by another attempt of the key, is not."""
    history.attempt(1, "lock_lost", 10, lock_pid=None, lock_key=42)
    history.attempt(2, "completed", 13, lock_pid=None, lock_key=42)
    history.lease_lost(1, 42, token=7, taken_over=12)
    history.work(1, 11, 11.5)
    history.work(2, 13.5, 14)
    assert AFTER_LOCK_LOST not in history.violated()
    history.work(1, 11.8, 12.5)
    assert AFTER_LOCK_LOST in history.violated()


def test_a_running_attempt_needs_its_lock_session_or_its_live_lease(history: History) -> None:
    """After convergence a running attempt must still have its holder: its lock session (the
    advisory mode), or a live lease of its key taken before it started (the lease mode)."""
    holder = "no running attempt without a live holder"

    def violated() -> set[str]:
        found = invariants.check(history.conn, [D], ("converged",))
        return {v.invariant.name for v in found}

    live_pid = history.conn.execute("SELECT pg_backend_pid()").fetchone()
    assert live_pid is not None
    history.attempt(1, "running", 10, lock_pid=live_pid[0], lock_key=42)
    assert holder not in violated()
    history.attempt(2, "running", 10, lock_pid=None, lock_key=43)
    assert holder in violated()  # no lease at all
    history.conn.execute(
        "INSERT INTO idempotency.run_leases (lock_key, holder, acquired_at, renewed_at,"
        " expires_at) VALUES (43, 'w', %s, %s, clock_timestamp() + interval '1 minute')",
        (at(9), at(9)),
    )
    assert holder not in violated()
    history.conn.execute("UPDATE idempotency.run_leases SET acquired_at = %s", (at(11),))
    assert holder in violated()  # a lease taken after it started: another run's
    history.conn.execute(
        "UPDATE idempotency.run_leases SET acquired_at = %s, expires_at = clock_timestamp()",
        (at(9),),
    )
    assert holder in violated()  # its lease expired


def test_commit_after_a_later_attempt_started_is_caught(history: History) -> None:
    """Work committed after a later attempt of the key started is caught; a later no-op or
    lock_held attempt (recorded with the lock transaction's BEGIN time) does not count."""
    history.attempt(1, "lock_lost", 0)
    history.attempt(2, "noop", 3)
    history.attempt(3, "lock_held", 3)
    history.work(1, 1, 4)
    assert AFTER_SUCCESSOR not in history.violated()
    history.attempt(4, "completed", 3.5, lock_pid=101, lock_key=43)
    assert AFTER_SUCCESSOR in history.violated()


def test_a_request_after_the_confirmation_is_caught(history: History) -> None:
    """A request for a confirmed key that reached the remote after the ledger recorded the
    confirmation is caught; requests before it (tries the client gave up on) are not."""
    key = "finalize_invoices:2026-10-01:order_1"
    history.remote_invoice(key, 1)
    history.confirmed(key, 10)
    history.request(key, 8, "created")
    history.request(key, 9, "replayed")
    assert RESENT not in history.violated()
    history.request(key, 11, "fail")
    assert RESENT in history.violated()


def test_two_remote_invoices_for_one_order_are_caught(history: History) -> None:
    """Two remote invoices for one order (under different keys) break one-invoice-per-order,
    and a key naming another order breaks the key rule."""
    history.remote_invoice("finalize_invoices:2026-10-01:order_1", 1)
    assert history.violated() == set()
    history.remote_invoice("finalize_invoices:2026-10-01:order_1b", 1)
    assert history.violated() == {
        "at most one remote invoice per order",
        "every remote key names its own order",
    }


def test_a_violation_prints_the_history_of_its_key(history: History) -> None:
    """A violation carries the key's attempts, witness rows, lock losses and the remote's
    requests."""
    key = "finalize_invoices:2026-10-01:order_1"
    history.attempt(1, "completed", 0)
    history.work(1, 1, 2)
    history.attempt(2, "completed", 3, lock_pid=101, lock_key=43)
    history.work(2, 4, 5)
    history.request(key, 4.5, "created")
    found = invariants.check(history.conn, [D], ALWAYS)
    text = next(v for v in found if v.invariant.name == RECOMPUTE_WITNESSED).text()
    assert f"history of {JOB} / {D}" in text
    assert "attempts (job_run_attempts): 2" in text and "attempt_id=2, job_name=" in text
    assert "work transactions (work_witness): 2" in text
    assert "requests at the remote (accounting.requests): 1" in text and key in text


def test_the_witness_takes_the_commit_time_at_commit_and_keeps_no_rolled_back_work(
    job_db: str,
) -> None:
    """A work transaction's witness row gets the database clock of its BEGIN and of its
    COMMIT (a deferred trigger); one rolled back, or a savepoint inside a rolled-back
    transaction (a dry run), leaves no row."""
    from invoicing import queries

    params = {"attempt_id": 1, "job_name": JOB, "run_key": D, "forced": False, "work": "w"}
    with psycopg.connect(job_db, autocommit=True) as conn:
        with conn.transaction():
            began = conn.execute("SELECT clock_timestamp()").fetchone()
            conn.execute(queries()["count_execution"], params)
            time.sleep(0.3)
            before_commit = conn.execute("SELECT clock_timestamp()").fetchone()
        with pytest.raises(ZeroDivisionError), conn.transaction():
            conn.execute(queries()["count_execution"], params)
            raise ZeroDivisionError
        with conn.transaction(force_rollback=True), conn.transaction():
            conn.execute(queries()["count_execution"], params)
        found = conn.execute("SELECT began_at, committed_at FROM work_witness").fetchall()
    assert began is not None and before_commit is not None
    assert len(found) == 1
    began_at, committed_at = found[0]
    assert began_at <= began[0] and committed_at >= before_commit[0]


def test_real_runs_leave_one_witness_row_per_execution_and_break_nothing(job_db: str) -> None:
    """The example's create_invoices run by the provider: the first run, a forced rerun and
    a forced dry run leave one plain and one forced witness row (a no-op and the dry run
    none), and every history invariant holds."""
    from invoicing import tasks

    def run(options: RunOptions = PLAIN) -> str:
        return run_job(job_db, JOB, tasks.create_invoices, options)

    assert [
        run(),
        run(),
        run(RunOptions(force=True)),
        run(RunOptions(force=True, dry_run=True)),
    ] == ["completed", "noop", "completed", "dry_run"]
    witnessed = invariants.rows(job_db, "history_witness", {"run_key": D, "job_name": JOB})
    assert [forced for _, _, _, _, forced, *_ in witnessed] == [False, True]
    checker = Checker()
    assert checker.check(job_db, [D], ALWAYS) == []
    assert set(checker.checked) == {i.name for i in INVARIANTS if i.when == "always"}


def test_fire_time_is_the_logical_date_of_the_scheduled_run() -> None:
    """The run that processes business date D fires at D+1 01:00 (Airflow 3's logical date);
    Airflow 2 names it by the start of its interval, D 01:00."""
    assert fire_time(D) == "2026-10-02T01:00:00+00:00"
    assert fire_time(dt.date(2026, 10, 31), "01:30") == "2026-11-01T01:30:00+00:00"
    assert fire_time(D, interval_start=True) == "2026-10-01T01:00:00+00:00"


def run_job(dsn: str, job: str, work: Any, options: RunOptions = PLAIN) -> str:
    """One run of the example's ``work`` by the provider (no Airflow); its outcome."""
    return run_idempotently(
        connect=lambda: psycopg.connect(dsn), job_name=job, run_key=D, work=work, options=options
    ).outcome.value


def test_end_state_invariants_hold_on_a_converged_date_and_catch_each_breakage(
    invoicing: Any,
) -> None:
    """A date run through create, totals, export and reconciliation breaks no invariant of
    any kind; then each damage to its end state (a lost remote invoice, stale totals, an
    order left unmarked, a ledger row reset) is caught by its invariant."""
    from invoicing import tasks

    invoicing.seed(D, orders=8)
    base_url = invoicing.service.url
    for job, work in (
        ("finalize_invoices.create_invoices", tasks.create_invoices),
        ("finalize_invoices.rebuild_totals", tasks.rebuild_daily_totals),
        ("finalize_invoices.export_invoices", lambda run: tasks.export_invoices(run, base_url)),
        ("daily_reconciliation", tasks.reconcile_stores),
    ):
        assert run_job(invoicing.dsn, job, work) == "completed"
    every: tuple[invariants.When, ...] = ("always", "quiescent", "converged")
    assert invariants.check(invoicing.dsn, [D], every) == []
    assert invariants.not_converged(invoicing.dsn, [D]) == []

    def breaks(statement: str) -> set[str]:
        with psycopg.connect(invoicing.dsn, autocommit=True) as conn:
            conn.execute("BEGIN")
            conn.execute(statement)
            found = {v.invariant.name for v in invariants.check(conn, [D], every)}
            conn.execute("ROLLBACK")
        return found

    assert breaks(
        "DELETE FROM accounting.invoices WHERE id = (SELECT min(id) FROM accounting.invoices)"
    ) == {
        "completed export: exactly one remote invoice per order",
        "completed export: every ledger row confirmed by the remote's invoice",
        "converged: every touched date finished everywhere",
    }
    assert breaks("UPDATE daily_invoice_totals SET amount_cents = amount_cents + 1") == {
        "completed totals = fresh recomputation",
    }
    assert breaks(
        "UPDATE orders SET invoiced_at = NULL WHERE order_id = (SELECT min(order_id) FROM orders)"
    ) == {
        "completed create: invoices = orders",
        "converged: every touched date finished everywhere",
    }
    assert breaks(
        "UPDATE idempotency.outbound_ledger SET status = 'pending'"
        " WHERE ledger_id = (SELECT min(ledger_id) FROM idempotency.outbound_ledger)"
    ) == {
        "completed export: every ledger row confirmed by the remote's invoice",
        "converged: every touched date finished everywhere",
    }
    assert breaks(
        "UPDATE idempotency.job_runs SET status = 'failed' WHERE job_name = 'daily_reconciliation'"
    ) == {"converged: every job of every touched date completed"}


def test_no_lock_or_lease_is_listed_before_the_provider_made_its_schema(pg_dsn: str) -> None:
    """Chaos looks for a lock session or a lease to end from its first step on, before any
    run created the bookkeeping schema: none is listed then (not an error)."""
    assert invariants.run_lock_sessions(pg_dsn) == []
    assert invariants.live_leases(pg_dsn) == []
