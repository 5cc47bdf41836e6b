"""The accounting service misbehaves at high rates while finalize_invoices exports.

The real service process injects the faults (see accounting_service/faults.py): 503 before
doing anything, a connection reset after committing, committing then hanging past the
client's 2 s timeout, added latency, and all of them at once. The DAG runs in-process
(``dag.test``, with Airflow's retries of the export task); if a run still ends with
effects pending (every try of some key failed), the date is run again, at most 5 times.
The end is always the same: one remote invoice per order, every ledger row confirmed with
the remote's reference, and every request the service saw accounted for in the ledger.
"""

from __future__ import annotations

from typing import Any

import pendulum
import pytest
from airflow.dag_processing.dagbag import BundleDagBag

from airflow_helpers import SUCCESS, task_states
from devtools.airflow_env import DAGS_FOLDER
from test_faults_support import (
    FIRE,
    NO_PROBLEMS,
    D,
    check_consistency,
    connection_env,
    figures,
    final_state,
    rows,
    service_counts,
)

pytestmark = pytest.mark.usefixtures("airflow_home")

ORDERS = 150
MAX_RUNS = 5

SLOW = pytest.mark.slow
SCENARIOS = [
    pytest.param({"fail_rate": 0.4}, id="5xx_40pct", marks=SLOW),
    pytest.param({"reset_rate": 0.2}, id="resets_20pct"),
    pytest.param(
        {"reset_rate": 0.2, "reset_phase": "before_commit"}, id="resets_before_commit_20pct"
    ),
    pytest.param(
        {"timeout_after_commit_rate": 0.2, "hang_seconds": 5},
        id="commit_then_timeout_20pct",
        marks=SLOW,
    ),
    pytest.param({"latency_ms": 400}, id="latency_400ms"),
    pytest.param(
        {
            "fail_rate": 0.4,
            "reset_rate": 0.2,
            "timeout_after_commit_rate": 0.2,
            "hang_seconds": 5,
            "latency_ms": 50,
        },
        id="combined",
        marks=SLOW,
    ),
]
FAULT_COUNTERS = {
    "fail_rate": "fail",
    "reset_rate": "reset",
    "timeout_after_commit_rate": "timeout_after_commit",
}


def run_finalize() -> Any:
    bag = BundleDagBag(
        dag_folder=str(DAGS_FOLDER), bundle_path=DAGS_FOLDER, bundle_name="dags-folder"
    )
    return bag.dags["finalize_invoices"].test(logical_date=pendulum.parse(FIRE))


@pytest.mark.parametrize("faults", SCENARIOS)
def test_high_fault_rates_end_with_every_invoice_exported_once(
    invoicing: Any, monkeypatch: pytest.MonkeyPatch, faults: dict[str, Any]
) -> None:
    """With this fault mix the date converges within 5 runs to one remote invoice per order and every ledger row confirmed, with no duplicate."""
    invoicing.seed(D, orders=ORDERS)
    for name, value in connection_env(invoicing.dsn, invoicing.service.url, batch_size=50).items():
        monkeypatch.setenv(name, value)
    invoicing.service.set_faults(seed=11, **faults)

    runs: list[dict[str, Any]] = []
    for _ in range(MAX_RUNS):
        dag_run = run_finalize()
        state = final_state(invoicing.dsn)
        pending = sum(status != "succeeded" for _, status in state["ledger"])
        tasks = task_states(dag_run)
        runs.append(
            {"state": str(dag_run.state), "export": tasks["export_invoices"], "pending": pending}
        )
        # Converged means the export task succeeded (a failed export fails the run too:
        # test_a_failed_export_fails_the_dag_run).
        if tasks["export_invoices"] == "success":
            break
    stats = invoicing.service.stats()
    counts = service_counts(invoicing.service)
    calls = rows(invoicing.dsn, "SELECT sum(call_count) FROM idempotency.outbound_ledger")[0][0]
    figures(
        f"{faults}: {len(runs)} run(s) {[(r['state'], r['export'], r['pending']) for r in runs]}; "
        f"{counts['requests']} requests ({calls} calls in the ledger) for {ORDERS} invoices, "
        f"{counts['replays']} replays, "
        f"faults injected {stats['faults_injected']}"
    )
    assert runs[-1]["export"] == "success" and runs[-1]["state"] == str(SUCCESS), runs
    assert set(state["jobs"].values()) == {"completed"}
    assert len(state["invoices"]) == ORDERS and state["uninvoiced_orders"] == 0
    assert len(state["remote"]) == ORDERS
    assert [status for _, status in state["ledger"]] == ["succeeded"] * ORDERS
    assert check_consistency(invoicing.dsn) == NO_PROBLEMS
    assert counts["invoices"] == ORDERS
    # Every request the service saw was a call the ledger counted (none went unrecorded);
    # a call can fail before reaching the service (a stale keep-alive connection), so the
    # ledger may count a few more.
    assert counts["requests"] <= calls <= counts["requests"] + 5, (calls, counts)
    # The faults really happened.
    for rate, counter in FAULT_COUNTERS.items():
        if faults.get(rate):
            assert stats["faults_injected"][counter] > 0, stats


def test_a_failed_export_fails_the_dag_run(invoicing: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """When every export call fails until the task's retries are exhausted, the DAG run ends failed, not successful."""
    invoicing.seed(D, orders=5)
    for name, value in connection_env(
        invoicing.dsn, invoicing.service.url, max_attempts=2, backoff_max=0.05
    ).items():
        monkeypatch.setenv(name, value)
    invoicing.service.set_faults(fail_rate=1.0)
    dag_run = run_finalize()
    assert task_states(dag_run)["export_invoices"] == "failed"
    assert dag_run.state != SUCCESS
