"""The invoice-finalization DAG with real Airflow, real Postgres and the real accounting service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pendulum
import psycopg
import pytest

from devtools.airflow_env import DAGS_FOLDER
from support.dag_runs import SUCCESS, load_dag_bag, run_dag, scheduled_logical_date, task_states
from support.db import rows
from support.invoicing import InvoicingEnv
from support.locks import lock_held_attempts, run_lock_holders
from support.workers import Until, race, start_worker

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]

D = "2026-10-01"
FIRE = scheduled_logical_date(D)  # the scheduled run that processes business date D


def load_dags() -> Any:
    return load_dag_bag(DAGS_FOLDER)


def run_finalize(conf: dict[str, Any] | None = None, logical_date: Any = FIRE) -> Any:
    dag = load_dags().dags["finalize_invoices"]
    when = pendulum.parse(logical_date) if isinstance(logical_date, str) else logical_date
    return run_dag(dag, logical_date=when, conf=conf)


def job_details(dsn: str, job: str, run_key: str = D) -> dict[str, Any]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT details FROM idempotency.job_runs WHERE job_name = %s AND run_key = %s",
            (f"finalize_invoices.{job}", run_key),
        ).fetchone()
    return row[0] if row else {}


def attempts(dsn: str, job: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [
            o
            for (o,) in conn.execute(
                "SELECT outcome FROM idempotency.job_run_attempts WHERE job_name = %s ORDER BY attempt_id",
                (f"finalize_invoices.{job}",),
            )
        ]


def assert_converged(state: dict[str, Any]) -> None:
    """Invoices = orders, one remote invoice per order, every ledger row confirmed."""
    n = state["orders"]
    assert n > 0
    assert len(state["invoices"]) == n and state["uninvoiced_orders"] == 0
    assert len(state["remote"]) == n and state["remote_duplicate_orders"] == []
    assert [status for _, status, _ in state["ledger"]] == ["succeeded"] * n
    assert sum(count for _, count, _ in state["totals"]) == n


def test_dag_bag_loads_without_import_errors() -> None:
    """Every DAG file in dags/ imports cleanly, and the example DAGs are there."""
    bag = load_dags()
    assert bag.import_errors == {}
    assert {
        "finalize_invoices",
        "daily_reconciliation",
        "daily_reconciliation_pasted_twice",
    } <= set(bag.dags)


def test_applied_example_schema_takes_no_lock_while_other_dates_write(pg_dsn: str) -> None:
    """Tasks of other dates writing orders and invoices never wait on the schema check.

    Seen in a backfill: one date's create_invoices ran schema.sql's CREATE INDEX IF NOT
    EXISTS (a SHARE lock on the table, though the index existed) while another date's
    task was inserting invoices and updating orders, and Postgres killed one of them as a
    deadlock. Here the writer holds what create_invoices holds mid-statement; the check
    of a second worker must return without waiting for it.
    """
    from invoicing import ensure_example_schema

    with psycopg.connect(pg_dsn, autocommit=True) as first:
        ensure_example_schema(first)
        ensure_example_schema(first)  # applied once: the digest is recorded once
        assert first.execute("SELECT count(*) FROM invoicing_schema").fetchone() == (1,)
    with psycopg.connect(pg_dsn) as writer, psycopg.connect(pg_dsn, autocommit=True) as other:
        writer.execute("LOCK TABLE orders, invoices IN ROW EXCLUSIVE MODE")
        other.execute("SET lock_timeout = '2s'")
        ensure_example_schema(other)  # LockNotAvailable if it ran the DDL again
        with other.transaction():  # inside a transaction too (a dry run's connection)
            ensure_example_schema(other)
        writer.rollback()
        # A changed schema.sql (another digest) is applied again, once.
        other.execute("DROP INDEX orders_shipped_on_idx")
        other.execute("DELETE FROM invoicing_schema")
        ensure_example_schema(other)
        assert other.execute(
            "SELECT to_regclass('orders_shipped_on_idx') IS NOT NULL"
        ).fetchone() == (True,)


def test_date_run_twice_invoices_and_exports_once(invoicing: InvoicingEnv) -> None:
    """A date run twice: invoices = orders, one remote invoice per order, all confirmed; the second run is a no-op."""
    invoicing.seed(D, orders=150)
    first = run_finalize()
    assert first.state == SUCCESS, task_states(first)
    state = invoicing.state(D)
    assert_converged(state)
    assert job_details(invoicing.dsn, "create_invoices") == {
        "orders_seen": 150,
        "invoices_created": 150,
    }
    export = job_details(invoicing.dsn, "export_invoices")
    assert (export["exports_sent"], export["exports_skipped_existing"]) == (150, 0)
    requests_before = invoicing.service.stats()["requests"]

    second = run_finalize()
    assert second.state == SUCCESS
    assert invoicing.state(D) == state
    assert invoicing.service.stats()["requests"] == requests_before  # not a single call
    for job in ("create_invoices", "rebuild_totals", "export_invoices"):
        assert attempts(invoicing.dsn, job) == ["completed", "noop"]
    assert task_states(second)["reconcile_export"] == "skipped"


def test_force_recomputes_but_never_resends(invoicing: InvoicingEnv) -> None:
    """force reruns the internal writes of a completed date, and skips every confirmed export."""
    invoicing.seed(D, orders=80)
    run_finalize()
    state = invoicing.state(D)
    requests_before = invoicing.service.stats()["requests"]
    forced = run_finalize(conf={"run_key": D, "force": True, "dry_run": False}, logical_date=None)
    assert forced.state == SUCCESS, task_states(forced)
    assert invoicing.state(D) == state
    assert invoicing.service.stats()["requests"] == requests_before
    export = job_details(invoicing.dsn, "export_invoices")
    assert (export["exports_sent"], export["exports_skipped_existing"]) == (0, 80)
    assert job_details(invoicing.dsn, "create_invoices")["invoices_created"] == 0


def test_5xx_faults_are_retried_with_the_same_key(invoicing: InvoicingEnv) -> None:
    """With 30% of requests failing 503, every invoice is still exported exactly once."""
    invoicing.seed(D, orders=120)
    invoicing.service.set_faults(fail_rate=0.3)
    dr = run_finalize()
    assert dr.state == SUCCESS, task_states(dr)
    assert_converged(invoicing.state(D))
    stats = invoicing.service.stats()
    assert stats["faults_injected"]["fail"] > 0
    assert stats["invoices"] == 120


def test_commit_then_timeout_creates_no_second_invoice(invoicing: InvoicingEnv) -> None:
    """The service commits, then hangs past the client timeout: the retry with the same key is replayed."""
    invoicing.seed(D, orders=60)
    invoicing.service.set_faults(timeout_after_commit_rate=0.2, hang_seconds=3)
    dr = run_finalize()
    assert dr.state == SUCCESS, task_states(dr)
    state = invoicing.state(D)
    assert_converged(state)
    stats = invoicing.service.stats()
    assert stats["faults_injected"]["timeout_after_commit"] > 0 and stats["replays"] > 0


def test_connection_resets_are_retried(invoicing: InvoicingEnv) -> None:
    """Dropped connections (no HTTP answer at all) are retried with the same key: no duplicates."""
    invoicing.seed(D, orders=60)
    invoicing.service.set_faults(reset_rate=0.25)
    dr = run_finalize()
    assert dr.state == SUCCESS, task_states(dr)
    assert_converged(invoicing.state(D))


def test_worker_killed_mid_export_then_rerun_converges(
    invoicing: InvoicingEnv, airflow_home: Path
) -> None:
    """The worker is SIGKILLed after the service committed an invoice but before the ledger knew: the rerun sends no duplicate."""
    invoicing.seed(D, orders=200)
    env = {
        **invoicing.connection_env(),
        "AIRFLOW_IDEMPOTENCY_CRASH_AT": "ledger.after_remote_commit@90",
    }
    crashed = start_worker(
        airflow_home, "finalize_invoices", FIRE, invoicing.dsn, env, dags_folder=DAGS_FOLDER
    )
    out, _ = crashed.communicate(timeout=240)
    assert "fault point ledger.after_remote_commit@90: SIGKILL" in out, out[-3000:]
    middle = invoicing.state(D)
    assert 0 < len(middle["remote"]) < 200
    assert any(status == "pending" for _, status, _ in middle["ledger"])

    rerun = start_worker(
        airflow_home,
        "finalize_invoices",
        FIRE,
        invoicing.dsn,
        invoicing.connection_env(),
        dags_folder=DAGS_FOLDER,
    )
    out, _ = rerun.communicate(timeout=240)
    assert rerun.returncode == 0, out[-3000:]
    assert_converged(invoicing.state(D))


def test_force_reconcile_mends_pending_keys_with_the_same_key(invoicing: InvoicingEnv) -> None:
    """force_reconcile finds ledger rows left pending after the remote committed, and confirms them without duplicates."""
    invoicing.seed(D, orders=50)
    run_finalize()
    with psycopg.connect(invoicing.dsn, autocommit=True) as conn:
        # What a crash between the remote commit and the ledger update leaves behind.
        conn.execute(
            "UPDATE idempotency.outbound_ledger SET status = 'pending', remote_reference = NULL"
            " WHERE idempotency_key IN (SELECT idempotency_key FROM idempotency.outbound_ledger ORDER BY 1 LIMIT 7)"
        )
    dr = run_finalize(
        conf={"run_key": D, "force_reconcile": True, "force": False, "dry_run": False},
        logical_date=None,
    )
    assert dr.state == SUCCESS, task_states(dr)
    details = job_details(invoicing.dsn, "reconcile_export")
    assert details["reconcile_not_confirmed"] == 7 and details["reconcile_mended"] == 7
    assert details["reconcile_confirmed_missing_remotely"] == 0
    assert_converged(invoicing.state(D))


def test_schedule_pasted_twice_is_blocked_by_the_lock(
    invoicing: InvoicingEnv, airflow_home: Path, tmp_path: Path
) -> None:
    """Two DAGs with the same job name run the same date at once: one works, the other waits on the lock, then no-ops."""
    invoicing.seed(D, orders=30)
    fire = scheduled_logical_date(D, at="01:30")
    release = tmp_path / "release"
    held = {
        **invoicing.connection_env(),
        "AIRFLOW_IDEMPOTENCY_WAIT_AT": f"runner.after_started={release}",
    }
    first, second = race(
        lambda: start_worker(
            airflow_home, "daily_reconciliation", fire, invoicing.dsn, held, dags_folder=DAGS_FOLDER
        ),
        lambda: start_worker(
            airflow_home,
            "daily_reconciliation_pasted_twice",
            fire,
            invoicing.dsn,
            invoicing.connection_env(),
            dags_folder=DAGS_FOLDER,
        ),
        release,
        first_holds=Until(
            lambda: run_lock_holders(invoicing.dsn), "the first DAG to hold the job's lock"
        ),
        second_refused=Until(
            lambda: lock_held_attempts(invoicing.dsn), "the second DAG to find the job locked"
        ),
        wait=180,
    )
    assert first.returncode == 0, first.output[-3000:]
    assert second.returncode == 0, second.output[-3000:]
    assert "is locked by another execution" in second.output
    attempts = rows(
        invoicing.dsn,
        "SELECT dag_id, outcome FROM idempotency.job_run_attempts WHERE job_name = 'daily_reconciliation' ORDER BY attempt_id",
    )
    assert attempts[0] == ("daily_reconciliation", "completed")
    assert ("daily_reconciliation_pasted_twice", "lock_held") in attempts
    assert attempts[-1] == ("daily_reconciliation_pasted_twice", "noop")
    assert rows(invoicing.dsn, "SELECT count(*), max(runs) FROM reconciliation_summary") == [(1, 1)]
