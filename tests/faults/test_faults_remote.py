"""The accounting service misbehaves at high rates while finalize_invoices exports.

The real service process injects the faults (see accounting_service/faults.py): 503 before
doing anything, a connection reset after committing, committing then hanging past the
client's 2 s timeout, added latency, and all of them at once. The DAG runs in-process
(``dag.test``, with Airflow's retries of the export task); if a run still ends with
effects pending (every try of some key failed), the date is run again, at most 5 times.
The end is always the same: one remote invoice per order, every ledger row confirmed with
the remote's reference, and every request the service saw accounted for in the ledger.

The advisory mode only: the faults are the remote's, and what answers them (the ledger's
retries, its unknown outcomes, the replays under the same keys) does not know how the run
holds its key; a lease lost mid-export is tests/faults/test_faults_lock_loss.py's.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pendulum
import pytest
from airflow.dag_processing.dagbag import BundleDagBag

from devtools.airflow_env import DAGS_FOLDER
from support.dag_runs import SUCCESS, task_states
from support.db import rows
from support.effects import run_once
from support.faults import (
    FIRE,
    NO_PROBLEMS,
    D,
    check_consistency,
    connection_env,
    figures,
    final_state,
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
    logical = pendulum.parse(FIRE)
    assert isinstance(logical, pendulum.DateTime)
    return bag.dags["finalize_invoices"].test(logical_date=logical)


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
    ledger = rows(
        invoicing.dsn,
        "SELECT status, count(*) FROM idempotency.outbound_ledger GROUP BY status ORDER BY 1",
    )
    tries = rows(
        invoicing.dsn,
        "SELECT count(*) FROM idempotency.job_run_attempts"
        " WHERE job_name = 'finalize_invoices.export_invoices'",
    )[0][0]
    counts = service_counts(invoicing.service)
    assert counts["invoices"] == 0, counts
    figures(
        f"export_invoices failed after {tries} attempts, DAG run {dag_run.state};"
        f" ledger {dict(ledger)}; {counts['requests']} requests refused by the remote,"
        f" {counts['invoices']} invoices made there"
    )


def _export_until(dsn: str, url: str, items: Any, **options: Any) -> tuple[Any, float]:
    """One forced run exporting ``items``: (its exception or summary, seconds it took)."""
    import time

    from airflow_idempotency import OutboundLedger, RunContext, post_json

    out: dict[str, Any] = {}

    def work(run: RunContext) -> None:
        ledger = OutboundLedger(run, "accounting", **options)
        out["summary"] = ledger.send_all(
            items, post_json("/api/invoices"), base_url=url, timeout=2, total=400
        )

    started = time.monotonic()
    try:
        run_once(dsn, work, job="export", run_key=D, force=True)
    except Exception as exc:
        return exc, time.monotonic() - started
    return out["summary"], time.monotonic() - started


@pytest.mark.parametrize("killed_at", [0, 120], ids=["down_from_the_start", "killed_mid_export"])
def test_a_remote_that_is_down_fails_the_try_early_and_loses_nothing(
    pg_dsn: str, killed_at: int
) -> None:
    """The accounting service dies (before the export, or after 120 of 400 effects): the
    export stops once no call had any answer for unreachable_after (3 s) instead of every
    pending effect retrying on its own, fails with one message naming the service, the time
    and what is left pending; the rerun after the service is back sends each effect once."""
    import time

    from airflow_idempotency import Effect, Retries
    from airflow_idempotency.exceptions import RemoteUnreachableError
    from devtools.accounting import run_accounting_service

    def effects(service: Any) -> Any:
        for i in range(400):
            if i == killed_at:
                service.kill()
                killed["at"] = time.monotonic()
            yield Effect(f"{D}:order_{i}", {"order_id": i, "amount_cents": 100 + i})

    killed: dict[str, float] = {}
    with run_accounting_service(pg_dsn) as service:
        url = service.url
        error, took = _export_until(
            pg_dsn, url, effects(service), unreachable_after=3, batch_size=50,
            retries=Retries(max_attempts=8),
        )  # fmt: skip
    after_kill = time.monotonic() - killed["at"]  # the export had just returned
    assert isinstance(error, RemoteUnreachableError), error
    message = str(error)
    assert f"accounting unreachable at {url} since " in message
    assert "left pending" in message and "a rerun resends them with the same keys" in message
    assert after_kill < 30, after_kill  # 3 s of silence, plus in-flight timeouts and backoff
    statuses = rows(
        pg_dsn, "SELECT status, count(*) FROM idempotency.outbound_ledger GROUP BY 1 ORDER BY 1"
    )
    confirmed = dict(statuses).get("succeeded", 0)
    # The next batch is read (and the service killed) while the one before is claimed.
    assert confirmed <= killed_at and (killed_at == 0) == (confirmed == 0), statuses
    with run_accounting_service(pg_dsn) as service:
        again = (
            Effect(f"{D}:order_{i}", {"order_id": i, "amount_cents": 100 + i}) for i in range(400)
        )
        summary, _ = _export_until(pg_dsn, service.url, again)
        assert summary.ok and (summary.sent, summary.skipped_existing) == (
            400 - confirmed,
            confirmed,
        )
        remote = service.invoices(key_prefix=f"{D}:order_")
    assert len(remote) == 400 and len({r["idempotency_key"] for r in remote}) == 400
    figures(
        f"service killed after {killed_at} of 400 effects: the export failed {after_kill:.1f} s "
        f"after the kill ({took:.1f} s in all)"
        f" (unreachable_after 3 s, max_attempts 8); the rerun sent {400 - confirmed}, skipped "
        f"{confirmed} confirmed, 0 duplicates"
    )


def test_the_dag_fails_in_seconds_when_the_accounting_service_is_down(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """finalize_invoices with its accounting service dead: each try of the export stops
    after unreachable_after (the 10 s default) and the DAG run fails after its retries in
    well under a minute; when the service is back, a rerun exports every invoice once."""
    import time

    import psycopg

    from devtools.accounting import run_accounting_service
    from invoicing.seed import seed_orders

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        day = dt.date.fromisoformat(D)
        seed_orders(conn, day, day, 300, 7)
    with run_accounting_service(pg_dsn) as service:
        dead_url = service.url
        service.kill()
    for name, value in connection_env(pg_dsn, dead_url, timeout=5).items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    dag_run = run_finalize()
    took = time.monotonic() - started
    assert task_states(dag_run)["export_invoices"] == "failed" and dag_run.state != SUCCESS
    errors = rows(
        pg_dsn,
        "SELECT error FROM idempotency.job_run_attempts"
        " WHERE job_name = 'finalize_invoices.export_invoices' ORDER BY attempt_id",
    )
    assert len(errors) == 3  # the export task's three tries (retries=2)
    assert all("accounting unreachable at" in e for (e,) in errors), errors
    assert took < 90, took
    with run_accounting_service(pg_dsn) as service:
        for name, value in connection_env(pg_dsn, service.url).items():
            monkeypatch.setenv(name, value)
        assert run_finalize().state == SUCCESS
    assert check_consistency(pg_dsn) == NO_PROBLEMS
    state = final_state(pg_dsn)
    assert len(state["remote"]) == 300 and {s for _, s in state["ledger"]} == {"succeeded"}
    figures(
        f"accounting service down: the DAG run failed after {took:.0f} s (3 tries of the "
        "export, 5 s retry delay, unreachable_after 10 s); the rerun exported 300 of 300, "
        "0 duplicates"
    )
