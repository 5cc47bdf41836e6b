"""`airflow backfill create` over a week of the invoice DAG, with a real scheduler,
dag-processor and api-server: the first pass does the work once, the reprocessing pass
of the same range is all no-ops, and nothing is duplicated anywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from devtools.airflow_env import DAGS_FOLDER
from devtools.airflow_stack import airflow_stack
from support.db import rows
from support.invoicing import InvoicingEnv

pytestmark = pytest.mark.slow

BUSINESS_DATES = [f"2026-10-0{d}" for d in range(1, 8)]
FROM, TO = "2026-10-02T01:00:00+00:00", "2026-10-08T01:00:00+00:00"


def outcomes_by_pass(dsn: str) -> list[tuple[Any, ...]]:
    return rows(
        dsn,
        "SELECT outcome, job_name, count(*) FROM idempotency.job_run_attempts"
        " GROUP BY outcome, job_name ORDER BY job_name, outcome",
    )


def test_backfill_week_twice_without_duplicates(invoicing: InvoicingEnv, tmp_path: Path) -> None:
    """A 7-date backfill runs each date once; reprocessing the completed range only no-ops."""
    invoicing.seed(BUSINESS_DATES[0], BUSINESS_DATES[-1], orders=40)
    with airflow_stack(
        tmp_path / "home", DAGS_FOLDER, extra_env=invoicing.connection_env()
    ) as stack:
        stack.unpause("finalize_invoices")
        # The run fired at D+1 01:00 processes business date D. Backfill bounds are instants
        # (a bare date means 00:00), so name the fire times of the first and last runs.
        first = stack.backfill("finalize_invoices", FROM, TO, timeout=600)
        assert [r.state for r in first] == ["success"] * 7, stack.describe_runs(
            "finalize_invoices", [r.run_id for r in first]
        )
        assert all(r.run_type == "backfill" for r in first)
        states = {d: invoicing.state(d) for d in BUSINESS_DATES}
        for d in BUSINESS_DATES:
            assert len(states[d]["invoices"]) == 40 and len(states[d]["remote"]) == 40
            assert {s for _, s, _ in states[d]["ledger"]} == {"succeeded"}
        requests = invoicing.service.stats()["requests"]

        second = stack.backfill(
            "finalize_invoices", FROM, TO, reprocess_behavior="completed", timeout=600
        )
        assert [r.state for r in second] == ["success"] * 7
        assert {d: invoicing.state(d) for d in BUSINESS_DATES} == states
        assert invoicing.service.stats()["requests"] == requests

    with psycopg.connect(invoicing.dsn) as conn:
        per_job = conn.execute(
            "SELECT job_name, outcome, triggered_by, count(*) FROM idempotency.job_run_attempts"
            " GROUP BY 1, 2, 3 ORDER BY 1, 2"
        ).fetchall()
        unexpected = conn.execute(
            "SELECT job_name, run_key, outcome, try_number, error FROM idempotency.job_run_attempts"
            " WHERE outcome NOT IN ('completed', 'noop') ORDER BY attempt_id"
        ).fetchall()
        remote_dupes = conn.execute(
            "SELECT invoice->>'order_id' FROM accounting.invoices GROUP BY 1 HAVING count(*) > 1"
        ).fetchall()
    for job in ("create_invoices", "rebuild_totals", "export_invoices"):
        name = f"finalize_invoices.{job}"
        outcomes = {(o, t): n for j, o, t, n in per_job if j == name}
        # Each date worked exactly once; every later execution of it was a no-op (more than
        # 7 no-ops when the scheduler re-ran a task, e.g. after a heartbeat timeout).
        assert outcomes[("completed", "backfill")] == 7
        assert outcomes[("noop", "backfill")] >= 7
        assert set(outcomes) == {("completed", "backfill"), ("noop", "backfill")}, unexpected
    assert remote_dupes == []
