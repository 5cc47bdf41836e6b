"""The database restarts while a run is in progress: the run fails cleanly, the rerun converges.

Each test starts a PRIVATE embedded PostgreSQL (devtools.postgres.private_embedded, data
under the checkout's .pgdata/) so that it can stop and start it without disturbing anybody: ``pg_ctl
stop -m fast`` (a clean shutdown, sessions terminated) or ``-m immediate`` (like a crash
of the server: no checkpoint, WAL recovery on the next start), a few seconds down, then
the same server again on the same socket.

The in-process restarts run in the lease mode too (``test_restart_mid_run_in_the_lease_mode_*``):
a lease is a row, not a session, so it outlives the restart; the run's next fenced step then
either goes on under its lease or ends ``lock_lost`` cleanly, and the rerun converges. The
server down at the start (no decision reaches the database) and the Airflow export (its try
fails on the ended session, as any run's does) are the same in both modes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_idempotency.exceptions import IdempotencyError, LockLostError
from airflow_idempotency.runner import RunContext, RunOutcome, run_idempotently
from devtools.postgres import PostgresServer, private_embedded
from support.db import rows
from support.faults import (
    FIRE,
    NO_PROBLEMS,
    D,
    Watched,
    check_consistency,
    connection_env,
    figures,
    final_state,
    finish,
    kill_group,
    lock_modes_used,
    refusal,
    service_counts,
    spawn_worker,
)
from support.locks import advisory_locks

pytestmark = pytest.mark.slow

NO_HANG_SECONDS = 60.0


class PrivateServer:
    """An embedded server this test owns: a DSN, and restarts of the very same server."""

    def __init__(self, server: PostgresServer) -> None:
        self.server = server
        self.name = self.server.create_database("restart")
        self.dsn = self.server.dsn(self.name)

    def restart(self, mode: str = "fast", down_seconds: float = 2.0) -> float:
        """Stop the server (``fast`` or ``immediate``), wait, start it again; return seconds down."""
        before = self.server.admin_dsn
        seconds = self.server.restart(mode, down_seconds)
        assert self.server.admin_dsn == before  # the same DSN works again
        return seconds


@contextlib.contextmanager
def private_server() -> Iterator[PrivateServer]:
    """A :class:`PrivateServer`, stopped and its data removed afterwards."""
    with private_embedded("restart") as server:
        yield PrivateServer(server)


@pytest.fixture
def private() -> Iterator[PrivateServer]:
    with private_server() as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE public.effects (step text PRIMARY KEY, written_by int)")
        yield server


def both_steps(run: RunContext) -> dict[str, int]:
    """The work of the rerun: both steps, each written at most once."""
    write_step(run, "first")
    write_step(run, "second")
    return {"steps": 2}


def write_step(run: RunContext, step: str) -> None:
    """An effect written at most once: the natural key makes a rerun's write a no-op."""
    with run.transaction() as cur:
        cur.execute(
            "INSERT INTO public.effects VALUES (%s, %s) ON CONFLICT (step) DO NOTHING",
            (step, run.attempt_id),
        )


def run_in_thread(
    dsn: str, work: Callable[[RunContext], Any], lock_mode: str = "advisory"
) -> tuple[threading.Thread, dict[str, Any]]:
    """run_idempotently in a thread (``lock_mode``); the dict gets 'result' or 'error' and
    'seconds'."""
    box: dict[str, Any] = {}

    def target() -> None:
        began = time.monotonic()
        try:
            box["result"] = run_idempotently(
                connect=lambda: psycopg.connect(dsn, connect_timeout=5),
                job_name="nightly",
                run_key=D,
                work=work,
                lock_mode=lock_mode,
            )
        except BaseException as exc:
            box["error"] = exc
        box["seconds"] = time.monotonic() - began

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


@pytest.mark.parametrize("mode", ["fast", "immediate"])
@pytest.mark.parametrize("when", ["during_work", "before_completion"])
def test_restart_mid_run_fails_cleanly_and_the_rerun_converges(
    private: PrivateServer, mode: str, when: str
) -> None:
    """A server restart while the work runs (or just before its completion is written) makes the run raise promptly without completing, and the rerun after the restart completes it with each effect once."""
    paused = threading.Event()
    resume = threading.Event()

    def work(run: RunContext) -> dict[str, int]:
        write_step(run, "first")  # committed before the restart
        paused.set()
        assert resume.wait(120)
        if when == "during_work":
            write_step(run, "second")  # on a connection the restart has ended
        return {"steps": 2}

    thread, box = run_in_thread(private.dsn, work)
    assert paused.wait(60)
    down = private.restart(mode)
    resume.set()
    thread.join(NO_HANG_SECONDS)
    assert not thread.is_alive(), (
        f"run_idempotently still hangs {NO_HANG_SECONDS}s after the restart"
    )
    figures(
        f"{when}/{mode}: server down {down:.1f}s; the run raised "
        f"{type(box.get('error')).__name__} {box['seconds']:.1f}s after it began"
    )
    error = box.get("error")
    assert "result" not in box, box
    assert isinstance(error, psycopg.Error | IdempotencyError), repr(error)
    # Recorded as failed from a fresh session once the server was back, the attempt as
    # lock_lost either way: the restart ended the lock's session with the work's, so a write
    # in run.transaction() (during the work) and the completion write both report a lost lock.
    assert isinstance(error, LockLostError), repr(error)
    assert rows(private.dsn, "SELECT status FROM idempotency.job_runs") == [("failed",)]
    assert rows(private.dsn, "SELECT outcome FROM idempotency.job_run_attempts") == [("lock_lost",)]

    rerun = run_idempotently(
        connect=lambda: psycopg.connect(private.dsn),
        job_name="nightly",
        run_key=D,
        work=both_steps,
    )
    assert rerun.outcome is RunOutcome.COMPLETED
    assert rows(private.dsn, "SELECT status, attempt_count FROM idempotency.job_runs") == [
        ("completed", 2)
    ]
    assert rows(
        private.dsn, "SELECT step, count(*) FROM public.effects GROUP BY step ORDER BY step"
    ) == [
        ("first", 1),
        ("second", 1),
    ]
    assert advisory_locks(private.dsn, whole_server=True) == 0


@pytest.mark.parametrize("mode", ["fast", "immediate"])
@pytest.mark.parametrize("when", ["during_work", "before_completion"])
def test_restart_mid_run_in_the_lease_mode_goes_on_or_ends_lock_lost_and_converges(
    private: PrivateServer, mode: str, when: str
) -> None:
    """The lease mode: a server restart does not end the lease (a row), and the run never hangs: a restart just before the completion is written leaves the run going on, and it completes (its completion on a new session, under its lease); one while the work runs ends the work's session, so its next write ends the attempt lock_lost cleanly (it cannot know whether that transaction committed). Either way the rerun converges, each effect once, no lease left."""
    paused = threading.Event()
    resume = threading.Event()

    def work(run: RunContext) -> dict[str, int]:
        write_step(run, "first")  # committed before the restart
        paused.set()
        assert resume.wait(120)
        if when == "during_work":
            write_step(run, "second")  # on a connection the restart has ended
        return {"steps": 2}

    thread, box = run_in_thread(private.dsn, work, lock_mode="lease")
    assert paused.wait(60)
    down = private.restart(mode)
    resume.set()
    thread.join(NO_HANG_SECONDS)
    assert not thread.is_alive(), f"the run still hangs {NO_HANG_SECONDS}s after the restart"
    error = box.get("error")
    first = rows(private.dsn, "SELECT outcome FROM idempotency.job_run_attempts")
    figures(
        f"lease mode, {when}/{mode}: server down {down:.1f}s; the run "
        + (f"raised {type(error).__name__}" if error else "completed")
        + f" {box['seconds']:.1f}s after it began; attempts {[o for (o,) in first]}"
    )
    rerun = run_idempotently(
        connect=lambda: psycopg.connect(private.dsn),
        job_name="nightly",
        run_key=D,
        work=both_steps,
        lock_mode="lease",
    )
    steps = rows(private.dsn, "SELECT step, count(*) FROM public.effects GROUP BY 1 ORDER BY 1")
    assert lock_modes_used(private.dsn) == {"lease"}
    assert rows(private.dsn, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]
    assert advisory_locks(private.dsn, whole_server=True) == 0
    if when == "before_completion":  # the lease outlived the restart: the run went on
        assert error is None and first == [("completed",)], (repr(error), first)
        assert rerun.outcome is RunOutcome.NOOP
        assert steps == [("first", 1)]  # this work writes "second" only during_work
        return
    assert isinstance(error, LockLostError), repr(error)
    assert first == [("lock_lost",)]
    assert rerun.outcome is RunOutcome.COMPLETED
    assert rows(private.dsn, "SELECT status, attempt_count FROM idempotency.job_runs") == [
        ("completed", 2)
    ]
    assert steps == [("first", 1), ("second", 1)]


def test_server_down_at_the_start_fails_fast(private: PrivateServer) -> None:
    """A run that starts while the server is down fails at once with a connection error and writes nothing; once the server is back the run completes."""
    private.server.stop("fast")
    try:
        began = time.monotonic()
        with pytest.raises(psycopg.OperationalError) as refused:
            run_idempotently(
                connect=lambda: psycopg.connect(private.dsn, connect_timeout=5),
                job_name="nightly",
                run_key=D,
                work=lambda run: write_step(run, "first"),
            )
        took = time.monotonic() - began
        assert took < 10
    finally:
        private.server.start()
    assert rows(private.dsn, "SELECT to_regclass('idempotency.job_runs')") == [(None,)]
    began = time.monotonic()
    done = run_idempotently(
        connect=lambda: psycopg.connect(private.dsn),
        job_name="nightly",
        run_key=D,
        work=lambda run: write_step(run, "first"),
    )
    assert done.outcome is RunOutcome.COMPLETED
    figures(
        f"{refusal(refused.value, took)}; nothing written (no idempotency schema);"
        f" after the restart the run completed in {time.monotonic() - began:.2f} s"
    )


@pytest.mark.both_airflow_lines
def test_airflow_export_survives_a_database_restart(tmp_path: Path, airflow_home: Path) -> None:
    """finalize_invoices loses its database (job tables, ledger and the accounting service's store) mid-export: the task try fails, Airflow's retry completes it, and the state is that of a clean run."""
    from devtools.accounting import run_accounting_service
    from invoicing.seed import seed_orders

    with private_server() as private:
        day = dt.date.fromisoformat(D)
        with psycopg.connect(private.dsn, autocommit=True) as conn:
            seed_orders(conn, day, day, 100, 7)
        with run_accounting_service(private.dsn) as service:
            env = connection_env(private.dsn, service.url, batch_size=20)
            worker = Watched(
                spawn_worker(
                    airflow_home,
                    tmp_path / "worker",
                    private.dsn,
                    {**env, "AIRFLOW_IDEMPOTENCY_SLEEP_AT": "ledger.before_record_outcomes=6"},
                )
            )
            try:
                worker.wait_for("fault point ledger.before_record_outcomes: ")
                down = private.restart("fast")
                code, out = worker.finish()
            finally:
                kill_group(worker.proc)
            assert code == 0, out[-4000:]
            # The try that lost its database failed on it (AdminShutdown is an OperationalError).
            assert "AdminShutdown" in out or "OperationalError" in out, out[-4000:]
            attempts = rows(
                private.dsn,
                "SELECT outcome FROM idempotency.job_run_attempts"
                " WHERE job_name = 'finalize_invoices.export_invoices' ORDER BY attempt_id",
            )
            figures(f"database down {down:.1f}s; export attempts {attempts}")
            assert attempts[-1] == ("completed",) and len(attempts) >= 2
            state = final_state(private.dsn)
            assert len(state["remote"]) == 100 and len(state["invoices"]) == 100
            assert [s for _, s in state["ledger"]] == ["succeeded"] * 100
            assert set(state["jobs"].values()) == {"completed"}
            assert check_consistency(private.dsn) == NO_PROBLEMS
            # The batch sent before the restart was resent with the same keys: replayed.
            counts = service_counts(service)
            assert (counts["invoices"], counts["replays"]) == (100, 20), counts
            # A rerun of the date afterwards is a no-op that sends nothing.
            before = service.stats()["requests"]
            again, again_out, _ = finish(
                spawn_worker(airflow_home, tmp_path / "rerun", private.dsn, env, date=FIRE)
            )
            assert again == 0, again_out[-4000:]
            assert service.stats()["requests"] == before
            assert final_state(private.dsn) == state
