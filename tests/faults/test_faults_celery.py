"""The invoice DAG set on Airflow's CeleryExecutor: two workers, each with its own hostname.

A real scheduler, dag-processor and api-server with Postgres as Airflow's metadata database
(as in production, instead of SQLite), Redis as the Celery broker, and two ``airflow celery
worker`` processes as separate "hosts" (each in its own UTS namespace). Overlapping at once:
a 7-date backfill, manual triggers with ``run_key`` of 3 of those dates, and the pasted-twice
DAG pair. Mid-export, the worker running the first export is SIGKILLed with everything it
started (a machine that died, its lock session closed by the kernel); the scheduler fails
that task into its retry and the other worker completes the date.

Nothing in the provider knows about Celery: the lock and the records in Postgres are what
keep each date's work to one execution, wherever the task runs.

The advisory mode only: it starts Airflow's processes (the critical path of CI) and a worker
killed mid-export is the crash matrix's SIGKILL of a worker, which runs in the lease mode too
(tests/faults/test_faults_crash_matrix.py, ``-lease``).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from devtools.airflow_env import DAGS_FOLDER
from devtools.airflow_stack import REDIS_URL, AirflowStack, airflow_stack
from devtools.postgres import PostgresServer
from support.db import rows
from support.faults import figures
from support.invoice_env import InvoicingEnv
from support.locks import advisory_locks

pytestmark = [pytest.mark.slow, pytest.mark.airflow_processes]

DATES = [f"2026-10-0{d}" for d in range(1, 8)]
MANUAL = ["2026-10-02", "2026-10-04", "2026-10-06"]
PASTED_DATE = "2026-10-03"
ORDERS = 30
EXPORT = "finalize_invoices.export_invoices"
JOBS = ("create_invoices", "rebuild_totals", "export_invoices")


def redis_answers(url: str = REDIS_URL) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port or 6379), timeout=2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture
def metadata_dsn(pg_server: PostgresServer) -> Iterator[str]:
    """A database of its own for Airflow's metadata."""
    name = pg_server.create_database("idem_airflow_meta")
    try:
        yield pg_server.dsn(name)
    finally:
        pg_server.drop_database(name)


def paused_export(dsn: str) -> tuple[str, str] | None:
    """(hostname, run_key) of a running export attempt that has already made the remote
    create an invoice: every export waits at ledger.after_remote_commit until the gate
    file exists, so that attempt is paused right after a remote commit it has not recorded."""
    if rows(dsn, "SELECT to_regclass('idempotency.job_run_attempts')") == [(None,)]:
        return None  # no task has run yet
    found = rows(
        dsn,
        "SELECT a.hostname, a.run_key FROM idempotency.job_run_attempts a"
        " WHERE a.job_name = %s AND a.outcome = 'running' AND EXISTS ("
        "   SELECT 1 FROM accounting.invoices i WHERE i.invoice->>'business_date' = a.run_key)"
        " ORDER BY a.attempt_id LIMIT 1",
        (EXPORT,),
    )
    return (found[0][0], found[0][1]) if found else None


def wait_for(predicate: Any, timeout: float, what: str, stack: AirflowStack) -> Any:
    deadline = time.monotonic() + timeout
    while (result := predicate()) is None:
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {name}:\n{stack.log_path(name).read_text(errors='replace')[-3000:]}"
                for name in stack.components
                if name.startswith("celery-worker-") or name == "scheduler"
            )
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}")
        time.sleep(0.5)
    return result


def all_runs_done(stack: AirflowStack, dag_ids: list[str]) -> list[Any] | None:
    runs = [run for dag_id in dag_ids for run in stack.dag_runs(dag_id)]
    if runs and all(run.state in ("success", "failed") for run in runs):
        return runs
    return None


def test_celery_workers_overlapping_runs_and_a_worker_killed_mid_export(
    invoicing: InvoicingEnv, metadata_dsn: str, tmp_path: Path
) -> None:
    """Two Celery workers, a 7-date backfill, manual reruns of 3 dates and the pasted pair at once, one worker SIGKILLed mid-export: each date's work runs once, the survivor finishes the export on retry, one remote invoice per order, no lock left."""
    if not redis_answers():
        if os.environ.get("CI"):
            pytest.fail(f"no Redis answers at {REDIS_URL} (.ci/run starts one)")
        pytest.skip(f"no Redis at {REDIS_URL} (IDEMPOTENCY_REDIS_URL)")
    for day in DATES:
        invoicing.seed(day, orders=ORDERS)
    gate = tmp_path / "exports-may-go-on"
    env = {
        **invoicing.connection_env(),
        "AIRFLOW_IDEMPOTENCY_WAIT_AT": f"ledger.after_remote_commit={gate}",
    }
    with airflow_stack(
        tmp_path / "home",
        DAGS_FOLDER,
        extra_env=env,
        metadata_dsn=metadata_dsn,
        celery_workers=["worker-a", "worker-b"],
        start_timeout=300,
    ) as stack:
        dag_ids = ["finalize_invoices", "daily_reconciliation", "daily_reconciliation_pasted_twice"]
        for dag_id in dag_ids:
            stack.unpause(dag_id, timeout=180)
        # All at once: the backfill (fire times of business dates 10-01..10-07), manual
        # reruns of three of its dates, and the pasted pair on one date.
        stack.airflow(
            "backfill", "create", "--dag-id", "finalize_invoices",
            "--from-date", "2026-10-02T01:00:00+00:00", "--to-date", "2026-10-08T01:00:00+00:00",
            "--max-active-runs", "7",
        )  # fmt: skip
        for day in MANUAL:
            stack.api(
                "POST",
                "/api/v2/dags/finalize_invoices/dagRuns",
                {"logical_date": None, "conf": {"run_key": day}},
            )
        for dag_id in dag_ids[1:]:
            stack.api(
                "POST", f"/api/v2/dags/{dag_id}/dagRuns",
                {"logical_date": None, "conf": {"run_key": PASTED_DATE}},
            )  # fmt: skip

        host, key = wait_for(
            lambda: paused_export(invoicing.dsn), 400, "an export paused mid-way", stack
        )
        stack.kill_component(f"celery-worker-{host}")
        killed_at = time.monotonic()
        gate.touch()
        survivor = ({"worker-a", "worker-b"} - {host}).pop()

        runs = wait_for(lambda: all_runs_done(stack, dag_ids), 600, "every run to finish", stack)
        settled = time.monotonic() - killed_at
        assert {run.state for run in runs} == {"success"}, [(run.run_id, run.state) for run in runs]
        assert len(runs) == 7 + 3 + 2
        killed_ti = rows(
            metadata_dsn,
            "SELECT ti.try_number, ti.hostname FROM task_instance ti"
            " JOIN dag_run r ON r.dag_id = ti.dag_id AND r.run_id = ti.run_id"
            " WHERE ti.task_id = 'export_invoices' AND ti.try_number > 1",
        )

    dsn = invoicing.dsn
    # Each date's work once: one completed attempt per job and date, every other execution
    # a no-op (or a try that found the lock held and came back).
    completed = rows(
        dsn,
        "SELECT job_name, run_key, count(*) FROM idempotency.job_run_attempts"
        " WHERE outcome = 'completed' GROUP BY 1, 2 ORDER BY 1, 2",
    )
    assert completed == sorted(
        [(f"finalize_invoices.{job}", day, 1) for job in JOBS for day in DATES]
        + [("daily_reconciliation", PASTED_DATE, 1)]
    )
    assert rows(dsn, "SELECT DISTINCT status FROM idempotency.job_runs") == [("completed",)]
    outcomes = {
        o for (o,) in rows(dsn, "SELECT DISTINCT outcome FROM idempotency.job_run_attempts")
    }
    # lock_lost: the attempts of the killed worker, closed by the attempt that took over.
    assert outcomes <= {"completed", "noop", "lock_held", "lock_lost"}, outcomes
    # The killed worker's export: its attempt closed as abandoned by the survivor, which
    # completed that date on the task's retry.
    abandoned = rows(
        dsn,
        "SELECT hostname, run_key FROM idempotency.job_run_attempts"
        " WHERE job_name = %s AND outcome = 'lock_lost' AND error LIKE 'abandoned:%%'",
        (EXPORT,),
    )
    assert (host, key) in abandoned, abandoned
    assert rows(
        dsn,
        "SELECT hostname FROM idempotency.job_run_attempts"
        " WHERE job_name = %s AND run_key = %s AND outcome = 'completed'",
        (EXPORT, key),
    ) == [(survivor,)]
    assert any(h == survivor for _, h in killed_ti), killed_ti
    # Both workers ran tasks, each under its own hostname.
    hosts = {h for (h,) in rows(dsn, "SELECT DISTINCT hostname FROM idempotency.job_run_attempts")}
    assert hosts == {"worker-a", "worker-b"}, hosts

    # One remote invoice per order, every order invoiced, every effect confirmed.
    for day in DATES:
        state = invoicing.state(day)
        assert state["orders"] == ORDERS and state["uninvoiced_orders"] == 0
        assert len(state["invoices"]) == ORDERS and len(state["remote"]) == ORDERS
        assert {status for _, status, _ in state["ledger"]} == {"succeeded"}
    assert invoicing.state(DATES[0])["remote_duplicate_orders"] == []
    assert rows(dsn, "SELECT count(*) FROM accounting.invoices") == [(ORDERS * len(DATES),)]
    # The paused effect had reached the remote: the retry resent it with the same key, and
    # the remote answered with its first response (a replay), not a second invoice.
    assert invoicing.service.stats()["replays"] >= 1
    attempts = rows(dsn, "SELECT outcome, count(*) FROM idempotency.job_run_attempts GROUP BY 1")
    figures(
        f"{len(runs)} DAG runs on 2 Celery workers; {host} SIGKILLed mid-export of {key}, "
        f"every run finished {settled:.0f} s later (heartbeat timeout 30 s); attempts "
        f"{dict(sorted(attempts))}; {invoicing.service.stats()['replays']} replay(s), "
        f"{ORDERS * len(DATES)} remote invoices for {ORDERS * len(DATES)} orders"
    )
    assert advisory_locks(dsn) == 0  # no lock left behind in the job database
