"""The contract behind a real PgBouncer (Debian's), in each pool mode.

In ``pool_mode = transaction`` consecutive statements of one client may run on different
server connections, and one server connection serves many clients: a session-level
advisory lock is shared, and session settings (search_path) reach other clients. The run
lock is held by a transaction kept open for the whole run, which pins one server
connection; every statement names its schema; every setting is SET LOCAL. So runs behind
transaction pooling are as safe as on a direct connection. ``statement`` mode cannot hold
a transaction: refused loudly, before any work or record. ``session`` mode is a direct
connection that is handed back, reset, when the client leaves.

PgBouncer runs as ``nobody`` (it refuses root), started and stopped by these tests; `.ci/run`
installs it when missing.

The lease mode (docs/locks.md) is the one a transaction pooler needs: it pins no server
connection for the run. The one-key race, the example DAG, the session lock left on a pooled
connection and statement pooling run in both modes (ids ``[lease]``); the pool sizing runs in
the lease mode as its own test: more runs than the pool's server connections hold their keys
at once and all complete. Session pooling (a direct connection lent for the client's
lifetime) and the two Airflow workers on one key (the one-key race through Airflow: the same
decision as the in-process race) stay in the advisory mode.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pendulum
import psycopg
import pytest

from airflow_idempotency import ConfigurationError, RunContext, RunLockedError, run_idempotently
from airflow_idempotency.exceptions import SharedSessionError
from airflow_idempotency.locks import run_lock_key
from devtools import pgbouncer
from devtools.airflow_env import DAGS_FOLDER, connection_env
from devtools.postgres import PostgresServer
from support.dag_runs import FAILED, SUCCESS, load_dag_bag, run_dag, scheduled_logical_date
from support.db import rows
from support.effects import run_once
from support.faults import figures, lock_extra, lock_modes_used, refusal
from support.locks import advisory_locks
from support.workers import Until, race, start_worker, work_log_count

D = "2026-10-01"


@pytest.fixture(scope="module", autouse=True)
def _pgbouncer_installed() -> None:
    if not pgbouncer.installed():
        if os.environ.get("CI"):
            pytest.fail(
                "pgbouncer is not installed (.ci/run installs it: apt-get install pgbouncer)"
            )
        pytest.skip("pgbouncer is not installed: apt-get install pgbouncer")


@pytest.fixture(scope="module")
def tx_bouncer(pg_server: PostgresServer) -> Iterator[pgbouncer.PgBouncer]:
    """pool_mode = transaction, two server connections per database: reuse is certain."""
    with pgbouncer.run_pgbouncer(pg_server, "transaction", pool_size=2) as bouncer:
        yield bouncer


def connect_through(dsn: str) -> Any:
    return lambda: psycopg.connect(dsn)


def dbname(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


def pooled_settings(
    bouncer: pgbouncer.PgBouncer, db: str, clients: int = 4
) -> set[tuple[str, str]]:
    """search_path and application_name as fresh clients of the pool see them."""
    conns = [psycopg.connect(bouncer.dsn(db), autocommit=True) for _ in range(clients)]
    try:
        seen: set[tuple[str, str]] = set()
        for c in conns:
            row = c.execute(
                "SELECT current_setting('search_path'), current_setting('application_name')"
            ).fetchone()
            assert row is not None
            seen.add((row[0], row[1]))
        return seen
    finally:
        for c in conns:
            c.close()


def race_one_key(dsn: str, job: str) -> tuple[list[str], list[BaseException]]:
    """Run one key twice at once through ``dsn``: the first holds it until the second
    has been refused (or, if the lock failed to exclude it, has run the work too)."""
    ran: list[str] = []
    errors: list[BaseException] = []
    holding = threading.Event()
    second_done = threading.Event()

    def first_work(run: RunContext) -> dict[str, int]:
        ran.append("first")
        holding.set()
        second_done.wait(30)
        return {"n": 1}

    def second_work(run: RunContext) -> dict[str, int]:
        ran.append("second")
        return {"n": 2}

    def first() -> None:
        try:
            run_idempotently(connect=connect_through(dsn), job_name=job, run_key=D, work=first_work)
        except BaseException as exc:
            errors.append(exc)
            holding.set()

    thread = threading.Thread(target=first)
    thread.start()
    assert holding.wait(30)
    try:
        run_idempotently(connect=connect_through(dsn), job_name=job, run_key=D, work=second_work)
    except BaseException as exc:
        errors.append(exc)
    finally:
        second_done.set()
        thread.join(60)
    return ran, errors


def test_transaction_pooling_one_key_runs_once(
    tx_bouncer: pgbouncer.PgBouncer, pg_dsn: str, lock_mode: str
) -> None:
    """Through transaction pooling, a second run of a key that is running is refused: the
    work runs once, the run completes once, no setting is left on a pooled connection."""
    dsn = tx_bouncer.dsn(dbname(pg_dsn))
    ran, errors = race_one_key(dsn, "tx_job")
    assert lock_modes_used(pg_dsn) == {lock_mode}
    assert ran == ["first"], ran
    assert [type(e) for e in errors] == [RunLockedError], errors
    assert rows(pg_dsn, "SELECT status, attempt_count FROM idempotency.job_runs") == [
        ("completed", 1)
    ]
    assert [
        o for (o,) in rows(pg_dsn, "SELECT outcome FROM idempotency.job_run_attempts ORDER BY 1")
    ] == [
        "completed",
        "lock_held",
    ]
    assert advisory_locks(pg_dsn) == 0
    settings = pooled_settings(tx_bouncer, dbname(pg_dsn))
    assert settings == {('"$user", public', "")}, settings
    figures(
        f"{lock_mode} mode: the work ran once; the second run {refusal(errors[0])}; attempts"
        " completed + lock_held; 0 advisory locks left; 4 pooled clients see search_path and"
        " application_name reset"
    )


def test_transaction_pooling_airflow_workers_run_a_key_once(
    tx_bouncer: pgbouncer.PgBouncer, airflow_home: Path, pg_dsn: str, tmp_path: Path
) -> None:
    """Two `airflow dags test` workers on one key, their job database behind transaction
    pooling: the work runs once (before the lock transaction, 3 of 3 keys ran twice)."""
    dsn = tx_bouncer.dsn(dbname(pg_dsn))
    release = tmp_path / "release"
    env = {"IDEM_TEST_HOLD_FILE": str(release), "IDEM_TEST_ON_LOCKED": "fail"}
    first, second = race(
        lambda: start_worker(airflow_home, "core_slow_job", "2026-10-02", dsn, env),
        lambda: start_worker(airflow_home, "core_slow_job", "2026-10-02", dsn, env),
        release,
        first_holds=Until(lambda: work_log_count(pg_dsn), "the first worker to start working"),
        second_refused=None,  # it fails at once (on_locked fail), while the first holds the key
        wait=120,
        finish=180,
    )
    assert first.returncode == 0, first.output[-3000:]
    refused = "is locked by another execution" in second.output
    assert second.returncode == 1 and refused, second.output[-3000:]
    assert rows(pg_dsn, "SELECT count(*) FROM public.work_log") == [(1,)]
    assert rows(pg_dsn, "SELECT status FROM idempotency.job_runs") == [("completed",)]
    figures(
        'worker 1 exit 0, worker 2 exit 1 ("is locked by another execution");'
        " work_log 1 row; job_runs completed"
    )


@pytest.mark.both_airflow_lines
@pytest.mark.parametrize("lock_mode", ["advisory", "lease"])
def test_transaction_pooling_example_dag_completes_with_its_invoices(
    tx_bouncer: pgbouncer.PgBouncer,
    invoicing: Any,
    airflow_home: Path,
    monkeypatch: pytest.MonkeyPatch,
    lock_mode: str,
) -> None:
    """finalize_invoices for a date of 200 orders, its job database behind transaction
    pooling: 200 invoices, 200 exported and confirmed, once (before, all three jobs said
    completed with 0 invoices: the lock session's search_path had leaked to the work). The
    lock mode is the job connection's extra ``lock_mode``, as an operator sets it."""
    invoicing.seed(D, orders=200)
    pooled = tx_bouncer.dsn(dbname(invoicing.dsn))
    for name, value in connection_env(pooled, job_extra=lock_extra(lock_mode)).items():
        monkeypatch.setenv(name, value)
    dag = load_dag_bag(DAGS_FOLDER).dags["finalize_invoices"]
    fire = pendulum.parse(scheduled_logical_date(D))
    assert run_dag(dag, logical_date=fire).state == SUCCESS
    again = run_dag(dag, logical_date=fire)
    assert again.state == SUCCESS
    state = invoicing.state(D)
    assert len(state["invoices"]) == 200 and state["uninvoiced_orders"] == 0
    assert len(state["remote"]) == 200 and state["remote_duplicate_orders"] == []
    assert [s for _, s, _ in state["ledger"]] == ["succeeded"] * 200
    outcomes = rows(
        invoicing.dsn,
        "SELECT job_name, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id",
    )
    assert [o for _, o in outcomes] == ["completed"] * 3 + ["noop"] * 3, outcomes
    assert lock_modes_used(invoicing.dsn) == {lock_mode}
    # The example's own tables stayed where they belong, none in the bookkeeping schema.
    assert rows(
        invoicing.dsn,
        "SELECT count(*) FROM pg_tables WHERE schemaname = 'idempotency' AND tablename = 'invoices'",
    ) == [(0,)]
    assert pooled_settings(tx_bouncer, dbname(invoicing.dsn)) == {('"$user", public', "")}
    figures(
        f"{lock_mode} mode: 200 invoices, 200 remote invoices (no duplicate order), 200 ledger"
        " rows succeeded; attempts: 3 completed, then 3 noop on the rerun"
    )


def test_a_session_lock_left_on_a_pooled_connection_is_refused(
    pg_server: PostgresServer, pg_dsn: str, lock_mode: str
) -> None:
    """A session-level lock left on a pooled server connection (an old client) would make
    taking the key "again" succeed there: the run refuses, writing nothing, running nothing."""
    with pgbouncer.run_pgbouncer(pg_server, "transaction", pool_size=1) as bouncer:
        dsn = bouncer.dsn(dbname(pg_dsn))
        with psycopg.connect(pg_dsn, autocommit=True) as direct:  # the schema, made directly
            from airflow_idempotency.schema import ensure_schema

            ensure_schema(direct)
        with psycopg.connect(dsn, autocommit=True) as old_client:
            old_client.execute("SELECT pg_advisory_lock(%s)", (run_lock_key("leaky", D),))
            called: list[int] = []
            with pytest.raises(SharedSessionError, match="already held run lock") as refused:
                run_once(dsn, lambda run: called.append(1), job="leaky", run_key=D)
            assert called == []
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.job_run_attempts") == [(0,)]
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.job_runs") == [(0,)]
    figures(f"{lock_mode} mode: {refusal(refused.value)}; work not run, 0 attempts, 0 job_runs")


@pytest.mark.parametrize("lock_mode", ["advisory", "lease"], indirect=True)
def test_statement_pooling_is_refused_before_anything(
    pg_server: PostgresServer, pg_dsn: str, lock_mode: str
) -> None:
    """Statement pooling cannot hold a transaction: the run fails with an error naming it and
    the fix, runs no work and records nothing on a fresh database. On a migrated one the
    lease mode's decision (one message: BEGIN, run_decide_lease, COMMIT) gets through and
    takes the lease; the start's transaction is then refused, the refusal is recorded as a
    failed attempt, and the lease released at once (one message, no transaction block), so
    that a retry is refused for the same reason, not as locked."""
    called: list[int] = []
    with pgbouncer.run_pgbouncer(pg_server, "statement", pool_size=2) as bouncer:
        dsn = bouncer.dsn(dbname(pg_dsn))
        with pytest.raises(
            ConfigurationError, match=r"statement mode.*pool_mode = transaction or session"
        ) as refused:
            run_once(dsn, lambda r: called.append(1), job="j", run_key=D)
        assert rows(pg_dsn, "SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'") == [
            (0,)
        ]
        with psycopg.connect(pg_dsn, autocommit=True) as direct:
            from airflow_idempotency.schema import ensure_schema

            ensure_schema(direct)
        for _ in range(2):  # the retry is refused for the same reason: nothing left held
            with pytest.raises(ConfigurationError, match="statement mode"):
                run_once(dsn, lambda r: called.append(1), job="j", run_key=D)
    assert called == []
    attempts = rows(pg_dsn, "SELECT outcome, error FROM idempotency.job_run_attempts")
    if lock_mode == "lease":
        assert [outcome for outcome, _ in attempts] == ["failed", "failed"], attempts
        assert all("statement mode" in error for _, error in attempts), attempts
        assert rows(pg_dsn, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]
    else:
        assert attempts == []
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.job_runs") == [(0,)]
    figures(
        f"{lock_mode} mode: {refusal(refused.value)}; work not run, no schema made; once "
        f"migrated {len(attempts)} attempt(s) recorded failed, no lease left"
    )


@pytest.mark.both_airflow_lines
def test_statement_pooling_fails_the_task_without_retrying(
    pg_server: PostgresServer, pg_dsn: str, airflow_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through Airflow, statement pooling fails the task at once (a configuration error: its
    retries are not used) with the reason in the log, nothing recorded."""
    from airflow.providers.common.compat.sdk import DAG

    from airflow_idempotency import IdempotentRunOperator
    from support.dag_runs import daily_trigger, utc

    with pgbouncer.run_pgbouncer(pg_server, "statement", pool_size=2) as bouncer:
        for name, value in connection_env(bouncer.dsn(dbname(pg_dsn))).items():
            monkeypatch.setenv(name, value)
        with DAG(
            "pgb_statement", schedule=daily_trigger(), start_date=utc(2026, 1, 1), catchup=False
        ) as dag:
            IdempotentRunOperator(task_id="work", python_callable=lambda run: None, retries=3)
        dr = run_dag(dag, logical_date=utc(2026, 10, 2))
    assert dr.state == FAILED
    assert dr.get_task_instances()[0].try_number == 1
    assert rows(pg_dsn, "SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'") == [(0,)]
    figures("DAG run failed on try 1 (3 retries left unused); no idempotency schema made")


def test_session_pooling_one_key_runs_once(pg_server: PostgresServer, pg_dsn: str) -> None:
    """Session pooling is a direct connection lent for the client's lifetime: a second run of
    a running key is refused, and the server connections go back with their settings reset."""
    with pgbouncer.run_pgbouncer(pg_server, "session", pool_size=3) as bouncer:
        dsn = bouncer.dsn(dbname(pg_dsn))
        ran, errors = race_one_key(dsn, "session_job")
        assert ran == ["first"] and [type(e) for e in errors] == [RunLockedError], (ran, errors)
        assert pooled_settings(bouncer, dbname(pg_dsn), clients=3) == {('"$user", public', "")}
    assert rows(pg_dsn, "SELECT status FROM idempotency.job_runs") == [("completed",)]
    assert advisory_locks(pg_dsn) == 0
    figures(
        f"the work ran once; the second run {refusal(errors[0])}; 3 server connections back"
        " with their settings reset; 0 advisory locks left"
    )


POOL_SIZE = 3
POOL_WAIT = 4  # PgBouncer's query_wait_timeout, seconds


def concurrent_runs(
    dsn: str, runs: int, holders: int
) -> list[tuple[str, BaseException | None, float]]:
    """``runs`` runs of distinct keys at once through ``dsn``. Each opens its work connection
    only once ``holders`` runs hold their lock transactions (each pinning one server
    connection), so the pool is as full as it gets; returns (key, error, seconds) per run."""
    import time

    arrived = threading.Barrier(holders)
    local = threading.local()

    def connect() -> psycopg.Connection[Any]:
        local.opened = getattr(local, "opened", 0) + 1
        if local.opened == 2:  # the work connection: its lock transaction is open
            arrived.wait(30)
        return psycopg.connect(dsn)

    def work(run: RunContext) -> None:
        for _ in range(2):
            with run.transaction() as cur:
                cur.execute("SELECT pg_sleep(0.2)")

    results: list[tuple[str, BaseException | None, float]] = []

    def one(key: str) -> None:
        began = time.monotonic()
        try:
            run_idempotently(connect=connect, job_name="pooled", run_key=key, work=work)
            results.append((key, None, time.monotonic() - began))
        except BaseException as exc:
            results.append((key, exc, time.monotonic() - began))

    threads = [threading.Thread(target=one, args=(f"k{i}",)) for i in range(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a run did not finish"
    return sorted(results)


@pytest.mark.parametrize(
    ("runs", "completes"),
    [(POOL_SIZE - 1, True), (POOL_SIZE, False), (POOL_SIZE + 1, False)],
    ids=["below", "at", "above"],
)
def test_pool_sizing_runs_below_the_pool_complete_and_others_fail_bounded(
    pg_server: PostgresServer, pg_dsn: str, runs: int, completes: bool
) -> None:
    """Transaction pooling with default_pool_size 3 and query_wait_timeout 4 s: 2 runs at once
    complete (N runs need N + 1 server connections: one pinned each by its lock, one shared
    by their statements); 3 or 4 at once cannot all make progress, and every run ends within
    the pool's wait timeout, failing with PoolExhaustedError naming the sizing rule (its
    attempt recorded), never a silent stall; each key then completes on a retry."""
    from airflow_idempotency.exceptions import PoolExhaustedError
    from airflow_idempotency.schema import ensure_schema

    with psycopg.connect(pg_dsn, autocommit=True) as direct:
        ensure_schema(direct)
    settings = {"query_wait_timeout": str(POOL_WAIT)}
    with pgbouncer.run_pgbouncer(pg_server, "transaction", POOL_SIZE, settings) as bouncer:
        dsn = bouncer.dsn(dbname(pg_dsn))
        results = concurrent_runs(dsn, runs, holders=min(runs, POOL_SIZE))
        failed = [(key, exc) for key, exc, _ in results if exc is not None]
        slowest = max(seconds for _, _, seconds in results)
        if completes:
            assert failed == [], failed
        else:
            assert failed, "every run completed: the pool was not exhausted"
            assert all(isinstance(exc, PoolExhaustedError) for _, exc in failed), failed
            assert all("N tasks need at least N + 1" in str(exc) for _, exc in failed)
            assert slowest <= POOL_WAIT + 6, slowest
            recorded = rows(
                pg_dsn,
                "SELECT run_key FROM idempotency.job_run_attempts WHERE outcome = 'failed'"
                " AND error LIKE '%%query_wait_timeout%%' ORDER BY run_key",
            )
            # a run refused before its lock transaction began has nothing to record it with
            assert len(recorded) >= len(failed) - max(0, runs - POOL_SIZE), recorded
            for key, _ in failed:  # a retry (one at a time) completes it
                run_idempotently(
                    connect=connect_through(dsn),
                    job_name="pooled",
                    run_key=key,
                    work=lambda r: None,
                )
    assert rows(
        pg_dsn, "SELECT count(*) FROM idempotency.job_runs WHERE status <> 'completed'"
    ) == [(0,)]
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.job_runs") == [(runs,)]
    figures(
        f"pool of {POOL_SIZE}, {runs} runs at once: "
        + (
            f"all completed, slowest {slowest:.1f} s"
            if completes
            else f"{len(failed)} failed with PoolExhaustedError after at most {slowest:.1f} s "
            f"(query_wait_timeout {POOL_WAIT} s), then completed on a retry"
        )
    )


def test_lease_mode_more_runs_than_the_pool_hold_their_keys_at_once_and_complete(
    pg_server: PostgresServer, pg_dsn: str
) -> None:
    """The lease mode through transaction pooling with default_pool_size 3 (query_wait_timeout
    4 s): 8 runs of distinct keys are all inside their work at once (each holding its key, as
    its lease) and all complete, each with two fenced transactions; the advisory mode's rule
    (N runs need N + 1 server connections, above) does not apply: nothing is pinned."""
    import time

    from airflow_idempotency.schema import ensure_schema

    runs = 8
    with psycopg.connect(pg_dsn, autocommit=True) as direct:
        ensure_schema(direct)
    all_in = threading.Barrier(runs)

    def work(run: RunContext) -> None:
        all_in.wait(60)  # every run holds its key now
        for _ in range(2):
            with run.transaction() as cur:
                cur.execute("SELECT pg_sleep(0.2)")

    settings = {"query_wait_timeout": str(POOL_WAIT)}
    errors: list[BaseException] = []
    with pgbouncer.run_pgbouncer(pg_server, "transaction", POOL_SIZE, settings) as bouncer:
        dsn = bouncer.dsn(dbname(pg_dsn))

        def one(key: str) -> None:
            try:
                run_idempotently(
                    connect=connect_through(dsn),
                    job_name="pooled",
                    run_key=key,
                    work=work,
                    lock_mode="lease",
                )
            except BaseException as exc:
                errors.append(exc)

        began = time.monotonic()
        threads = [threading.Thread(target=one, args=(f"k{i}",)) for i in range(runs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        took = time.monotonic() - began
    assert not any(t.is_alive() for t in threads), "a run did not finish"
    assert errors == [], errors
    assert rows(pg_dsn, "SELECT status, count(*) FROM idempotency.job_runs GROUP BY 1") == [
        ("completed", runs)
    ]
    assert lock_modes_used(pg_dsn) == {"lease"}
    assert rows(pg_dsn, "SELECT count(*) FROM idempotency.run_leases") == [(0,)]
    figures(
        f"lease mode, pool of {POOL_SIZE}: {runs} runs inside their work at once, all "
        f"completed in {took:.1f} s"
    )
