"""A worker cut off from Postgres by the network, for real: its own network namespace.

The worker runs ``airflow dags test`` inside a namespace whose only way to the job database
is a veth pair; the database is a private server listening on the host side of it. Taking
the link down drops every packet, with no FIN and no reset: each end learns of it only from
TCP keepalives and the user timeout (locks.DEAD_PEER_DEFAULTS, set on both ends of the lock
session). With Linux's defaults the server would keep the dead worker's lock for over two
hours. Needs root and iproute2.

The lease mode (docs/locks.md) holds no session for the key: a cut-off worker's lease simply
expires (``lease_ttl`` 5 s here) and a successor takes the key over, without waiting for the
server to give up on a dead peer; its late write is fenced all the same (the first scenario
runs in both modes, its ``lease`` case on the 3.x line only). The other scenarios are about
the server's bound on a dead peer's sessions (the notice within the bound, a work
transaction's row locks, a ledger batch's open claim): the same sessions and the same bound
in both modes.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from devtools import netns
from devtools.airflow_env import connection_env
from support.db import rows
from support.faults import figures, lease_rows, lock_extra, lock_modes_used
from support.locks import advisory_locks
from support.workers import (
    TEST_DAGS,
    dags_test,
    kill_group,
    private_airflow_env,
    start_worker,
    wait_until,
)

# Every scenario runs Airflow workers: on both lines (core_slow_job's timetable is explicit).
# On 2.11 too: how an Airflow task of each line loses its lock to a cut and reports it. The
# cuts inside an open work transaction and during a ledger batch prove the fence's SQL and
# the server's bound on the provider's own sessions, the same code on every line: 3.3 only.
ON_BOTH_LINES = pytest.mark.both_airflow_lines

DAY = "2026-10-02"  # core_slow_job's logical date: run key 2026-10-01
BOUND = 60  # seconds: the target for the lock of a dead worker


@pytest.fixture(scope="module")
def link() -> Iterator[netns.Link]:
    why = netns.available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    with netns.veth_namespace() as created:
        yield created


@pytest.fixture
def server(link: netns.Link) -> Iterator[tuple[netns.TcpPostgres, str]]:
    """A private server on the host side of the link, with one fresh job database."""
    with netns.tcp_postgres(link.host_ip) as pg:
        name = pg.server.create_database("partition")
        yield pg, name


def work_log(dsn: str) -> list[tuple[int, str]]:
    if not rows(dsn, "SELECT to_regclass('public.work_log') IS NOT NULL")[0][0]:
        return []
    return rows(dsn, "SELECT pid, phase FROM public.work_log ORDER BY at")


def cut_off_worker(
    link: netns.Link,
    airflow_home: Path,
    dsn: str,
    tmp_path: Path,
    dag_id: str = "core_slow_job",
    **env: str,
) -> subprocess.Popen[str]:
    """`airflow dags test DAG_ID` inside the namespace, reaching the job DB over the link."""
    worker_env = private_airflow_env(airflow_home, dsn, TEST_DAGS, home=tmp_path / "cut-off")
    worker_env.update(env)
    return dags_test(worker_env, dag_id, DAY, prefix=link.run_prefix())


def writing_after_the_hold(
    link: netns.Link, airflow_home: Path, dsn: str, tmp_path: Path, release: Path, **env: str
) -> subprocess.Popen[str]:
    """The cut-off worker of core_slow_job: its work holds until ``release`` exists (at most
    600 s), then writes once more, fenced; ``env`` added to its environment."""
    return cut_off_worker(
        link,
        airflow_home,
        dsn,
        tmp_path,
        IDEM_TEST_HOLD_FILE=str(release),
        IDEM_TEST_HOLD_MAX="600",
        IDEM_TEST_WRITE_AFTER_HOLD="1",
        **env,
    )


@pytest.mark.parametrize(
    "lock_mode", [pytest.param("advisory", marks=ON_BOTH_LINES), "lease"]
)  # the lease mode on the 3.x line only
def test_a_cut_off_workers_lock_is_freed_and_its_late_writes_are_fenced(
    link: netns.Link,
    server: tuple[netns.TcpPostgres, str],
    airflow_home: Path,
    tmp_path: Path,
    lock_mode: str,
) -> None:
    """Link cut mid-work: the cut-off worker's lock is freed (the advisory mode: Postgres frees
    it within the bound; the lease mode: its lease expires (5 s), without the server freeing
    anything), a second worker takes the key over and completes it, well within the bound; when
    the link returns, the cut-off worker's last write is refused (fenced), it fails its attempt
    cleanly, and the key stays completed, once."""
    pg, name = server
    local, remote = pg.local_dsn(name), pg.dsn(name)
    lease = lock_mode == "lease"
    release = tmp_path / "release"
    victim = writing_after_the_hold(
        link,
        airflow_home,
        remote,
        tmp_path,
        release,
        **connection_env(remote, job_extra=lock_extra(lock_mode)),
    )
    successor = None
    try:
        wait_until(
            lambda: len(work_log(local)) == 1, timeout=120, what="the worker to start working"
        )
        if lease:
            assert (advisory_locks(local), lease_rows(local)) == (0, 1)  # no lock session
        else:
            assert advisory_locks(local) == 1
        link.cut()
        cut_at = time.monotonic()
        # The successor runs on this side, rescheduling every second while the key is held.
        successor, successor_log = start_successor(
            airflow_home,
            local,
            tmp_path,
            "core_slow_job",
            IDEM_TEST_WRITE_AFTER_HOLD="1",
            **connection_env(local, job_extra=lock_extra(lock_mode)),
        )
        if not lease:
            wait_until(
                lambda: advisory_locks(local) == 0 or None,
                timeout=BOUND + 30,
                interval=0.2,
                what="the lock to be freed",
            )
            freed = time.monotonic() - cut_at
        taken_over = successor_completes(local, successor, successor_log, cut_at, timeout=120)
        out_v = reconnected(link, release, victim)
    finally:
        clean_up(link, release, victim, successor)
    if lease:
        assert taken_over <= BOUND, taken_over
    else:
        assert freed <= BOUND, freed
    assert victim.returncode == 1, out_v[-3000:]
    assert "LockLostError" in out_v, out_v[-3000:]
    phases = work_log(local)
    assert [phase for pid, phase in phases if pid == victim.pid] == ["start"], phases
    assert [phase for pid, phase in phases if pid == successor.pid] == ["start", "end"], phases
    attempts = rows(
        local, "SELECT pid, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id"
    )
    assert attempts[0] == (victim.pid, "lock_lost") and attempts[-1] == (successor.pid, "completed")
    if lease:
        assert rows(local, "SELECT status FROM idempotency.job_runs") == [("completed",)]
        assert lock_modes_used(local) == {"lease"}
        assert (advisory_locks(local), lease_rows(local)) == (0, 0)
    else:
        assert rows(
            local, "SELECT status, current_attempt_id IS NOT NULL FROM idempotency.job_runs"
        ) == [("completed", True)]
        assert advisory_locks(local) == 0
    freeing = (
        "a second worker had taken the expired lease over and completed the key "
        f"{taken_over:.1f} s after the cut (lease_ttl 5 s)"
        if lease
        else f"Postgres freed the lock after {freed:.1f} s (bound {BOUND} s), a second worker "
        f"had completed the key {taken_over:.1f} s after the cut"
    )
    figures(
        f"{'lease mode, ' if lease else ''}link cut mid-work: {freeing}; after the link "
        "returned, the cut-off worker's fenced write was refused (LockLostError), 0 rows "
        "written after the cut"
    )


@ON_BOTH_LINES
def test_a_cut_off_worker_notices_within_the_bound(
    link: netns.Link, server: tuple[netns.TcpPostgres, str], airflow_home: Path, tmp_path: Path
) -> None:
    """Link cut while the work is about to commit: the worker's statement hangs on the dead
    link only until the client's TCP user timeout, the task fails, and after the link
    returns a rerun takes the abandoned key over and completes it."""
    pg, name = server
    local, remote = pg.local_dsn(name), pg.dsn(name)
    release = tmp_path / "release"
    victim = writing_after_the_hold(link, airflow_home, remote, tmp_path, release)
    try:
        wait_until(
            lambda: len(work_log(local)) == 1, timeout=120, what="the worker to start working"
        )
        link.cut()
        release.touch()  # its fenced write now goes out over the dead link
        cut_at = time.monotonic()
        out, _ = victim.communicate(timeout=BOUND * 3)
        noticed = time.monotonic() - cut_at
    finally:
        link.restore()
        kill_group(victim)
    assert victim.returncode == 1, out[-3000:]
    assert noticed <= BOUND + 20, noticed  # the user timeout, then a bounded connect attempt
    wait_until(
        lambda: advisory_locks(local) == 0 or None, timeout=BOUND, what="the lock to be freed"
    )
    rerun = start_worker(airflow_home, "core_slow_job", DAY, local, {})
    out, _ = rerun.communicate(timeout=180)
    assert rerun.returncode == 0, out[-3000:]
    outcomes = rows(
        local, "SELECT outcome, error FROM idempotency.job_run_attempts ORDER BY attempt_id"
    )
    assert [o for o, _ in outcomes] == ["lock_lost", "completed"], outcomes
    assert rows(local, "SELECT status FROM idempotency.job_runs") == [("completed",)]
    assert [phase for _, phase in work_log(local)] == ["start", "start"]
    figures(f"link cut before a commit: the worker gave up and exited {noticed:.1f} s later")


def backends_from(dsn: str, address: str) -> list[tuple[Any, ...]]:
    """The server's backends of clients at ``address`` (the cut-off side): state, xid."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT state, backend_xid IS NOT NULL FROM pg_stat_activity"
            " WHERE host(client_addr) = %s",
            (address,),
        ).fetchall()


def holding_the_counter_row(dsn: str, address: str) -> bool:
    """Whether a backend of a client at ``address`` is idle inside the transaction whose last
    statement updated public.counter: the hold of core_jobs.slow_work, after the UPDATE.

    The state and the xid alone also match the work's first transaction (its CREATE TABLE
    assigns an xid) between two of its statements; a cut there would land after that commit,
    between the two transactions, where the work session is idle and holds nothing, so the
    server keeps it (no dead-peer bound outside a transaction) and the scenario is another one.
    """
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE host(client_addr) = %s"
            " AND state = 'idle in transaction' AND backend_xid IS NOT NULL"
            " AND query LIKE 'UPDATE public.counter%%')",
            (address,),
        ).fetchone()
    return bool(row and row[0])


def in_transaction(backends: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The backends that are inside a transaction: an idle session (here the work
    connection's, between its transactions) holds no lock, row or snapshot, and the server
    keeps it until the kernel's own keepalive gives up."""
    return [backend for backend in backends if backend[0] != "idle"]


def start_successor(
    airflow_home: Path, dsn: str, tmp_path: Path, dag_id: str, **env: str
) -> tuple[subprocess.Popen[str], Path]:
    """`airflow dags test DAG_ID` on this side of the link, rescheduling while the key is held
    (its output in a file: it logs ~1.5 kB a second, which fills a pipe nobody reads within a
    minute and then blocks it; seen: it hung before the lock was freed)."""
    log_path = tmp_path / f"successor-{dag_id}.log"
    successor_env = private_airflow_env(airflow_home, dsn, TEST_DAGS, home=tmp_path / "s")
    successor_env.update({"IDEM_TEST_ON_LOCKED": "reschedule", **env})
    with log_path.open("w") as log:
        return dags_test(successor_env, dag_id, DAY, output=log), log_path


def successor_completes(
    dsn: str,
    successor: subprocess.Popen[str],
    log_path: Path,
    cut_at: float,
    timeout: float = BOUND + 90,
) -> float:
    """Wait until the successor has completed the key and exited 0 (else fail with its
    attempts and its output); return the seconds since the cut."""
    try:
        wait_until(
            lambda: (
                rows(dsn, "SELECT status FROM idempotency.job_runs") == [("completed",)] or None
            ),
            timeout=timeout,
            interval=0.2,
            what="the successor to complete the key",
        )
    except AssertionError as exc:
        kill_group(successor)
        attempts = rows(
            dsn,
            "SELECT attempt_id, pid, outcome, error FROM idempotency.job_run_attempts"
            " ORDER BY attempt_id",
        )
        out = log_path.read_text(errors="replace")[-6000:]
        raise AssertionError(
            f"{exc}\nattempts: {attempts}\nthe successor's output:\n{out}"
        ) from None
    taken_over = time.monotonic() - cut_at
    successor.wait(timeout=120)
    assert successor.returncode == 0, log_path.read_text(errors="replace")[-3000:]
    return taken_over


def reconnected(link: netns.Link, release: Path, victim: subprocess.Popen[str]) -> str:
    """The link back and the cut-off worker released: its output, once it has exited."""
    link.restore()
    release.touch()
    out, _ = victim.communicate(timeout=180)
    return out


def clean_up(link: netns.Link, release: Path, *workers: subprocess.Popen[str] | None) -> None:
    """Whatever happened: the link back, the hold released, every worker's group killed."""
    release.touch()
    link.restore()
    for worker in workers:
        if worker is not None:
            kill_group(worker)


def test_a_cut_inside_a_work_transaction_holding_row_locks_ends_within_the_bound(
    link: netns.Link, server: tuple[netns.TcpPostgres, str], airflow_home: Path, tmp_path: Path
) -> None:
    """Link cut while the worker's work transaction holds a row lock (and its transaction id):
    the server ends that transaction within the bound, as it frees the lock, so a successor
    that updates the same row takes the key over and completes it; when the link returns, the
    cut-off worker's COMMIT is refused and nothing it wrote lands."""
    pg, name = server
    local, remote = pg.local_dsn(name), pg.dsn(name)
    with psycopg.connect(local, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.counter (id int PRIMARY KEY, n int NOT NULL, by_pid int)")
        conn.execute("INSERT INTO public.counter VALUES (1, 0, NULL)")
    release = tmp_path / "release"
    victim = cut_off_worker(
        link,
        airflow_home,
        remote,
        tmp_path,
        IDEM_TEST_HOLD_FILE=str(release),
        IDEM_TEST_HOLD_MAX="600",
        IDEM_TEST_UPDATE_COUNTER="1",
        IDEM_TEST_HOLD_IN_TRANSACTION="1",
    )
    successor = None
    try:
        wait_until(
            lambda: holding_the_counter_row(local, link.ns_ip),
            timeout=120,
            what="the worker's work transaction to hold its row lock",
        )
        link.cut()
        cut_at = time.monotonic()
        successor, log_path = start_successor(
            airflow_home, local, tmp_path, "core_slow_job", IDEM_TEST_UPDATE_COUNTER="1"
        )
        wait_until(
            lambda: backends_from(local, link.ns_ip) == [] or None,
            timeout=BOUND + 30,
            interval=0.2,
            what="the cut-off worker's backends (each was inside a transaction) to end",
        )
        ended = time.monotonic() - cut_at
        taken_over = successor_completes(local, successor, log_path, cut_at)
        out_v = reconnected(link, release, victim)
    finally:
        clean_up(link, release, victim, successor)
    assert ended <= BOUND, ended
    assert victim.returncode == 1 and "LockLostError" in out_v, out_v[-3000:]
    assert rows(local, "SELECT n, by_pid FROM public.counter") == [(1, successor.pid)]
    attempts = rows(
        local, "SELECT pid, outcome FROM idempotency.job_run_attempts ORDER BY attempt_id"
    )
    assert attempts[0] == (victim.pid, "lock_lost") and attempts[-1] == (successor.pid, "completed")
    assert advisory_locks(local) == 0
    figures(
        f"link cut inside a work transaction holding a row lock: the server ended it (and "
        f"every backend of the cut-off worker) {ended:.1f} s after the cut (bound {BOUND} s); "
        f"a successor updating the same row completed the key {taken_over:.1f} s after the "
        "cut; the cut-off worker's COMMIT was refused after the link returned, 0 rows of it"
    )


def test_a_cut_during_a_ledger_batch_leaves_nothing_the_cut_off_worker_sent(
    link: netns.Link, server: tuple[netns.TcpPostgres, str], airflow_home: Path, tmp_path: Path
) -> None:
    """Link cut while the worker's ledger has a batch's claim open (20 effects confirmed, the
    next 20 claimed and not committed): the server ends the claim within the bound, a successor
    sends the remaining effects under the same keys and completes; the remote holds one
    invoice per key, and nothing the cut-off worker sent lands after the successor started."""
    from devtools.accounting import run_accounting_service

    pg, name = server
    local, remote = pg.local_dsn(name), pg.dsn(name)
    release = tmp_path / "release"
    successor = None
    with run_accounting_service(local, host=link.host_ip) as service:
        victim = cut_off_worker(
            link,
            airflow_home,
            remote,
            tmp_path,
            "core_export_job",
            IDEM_TEST_HOLD_FILE=str(release),
            IDEM_TEST_HOLD_MAX="600",
            IDEM_TEST_HOLD_AT_EFFECT="41",
            IDEM_TEST_REMOTE_URL=service.url,
        )

        def claim_open() -> bool:
            ledger = "SELECT to_regclass('idempotency.outbound_ledger') IS NOT NULL"
            confirmed = "SELECT count(*) FILTER (WHERE status = 'succeeded') FROM idempotency.outbound_ledger"
            # the open claim holds a transaction id (in pipeline mode, with no Sync sent yet,
            # its backend shows "active", not "idle in transaction")
            return bool(
                rows(local, ledger)[0][0]
                and rows(local, confirmed) == [(20,)]
                and any(xid for _, xid in backends_from(local, link.ns_ip))
            )

        try:
            try:
                wait_until(claim_open, timeout=120, what="20 confirmed, the next claim open")
            except AssertionError as exc:
                kill_group(victim)
                out, _ = victim.communicate(timeout=30)
                statuses = rows(
                    local, "SELECT status, count(*) FROM idempotency.outbound_ledger GROUP BY 1"
                )
                raise AssertionError(
                    f"{exc}\nledger: {statuses}\nbackends: {backends_from(local, link.ns_ip)}"
                    f"\nthe worker's output:\n{out[-5000:]}"
                ) from None
            link.cut()
            cut_at = time.monotonic()
            successor, log_path = start_successor(
                airflow_home, local, tmp_path, "core_export_job", IDEM_TEST_REMOTE_URL=service.url
            )
            wait_until(
                lambda: in_transaction(backends_from(local, link.ns_ip)) == [] or None,
                timeout=BOUND + 30,
                interval=0.2,
                what="the cut-off worker's transactions (its open claim's too) to end",
            )
            ended = time.monotonic() - cut_at
            taken_over = successor_completes(local, successor, log_path, cut_at)
            requests_after_successor = service.stats()
            out_v = reconnected(link, release, victim)
            time.sleep(1)  # anything late would have arrived by now
            invoices = service.invoices("core_export:")
            requests_at_end = service.stats()
        finally:
            clean_up(link, release, victim, successor)
    assert ended <= BOUND, ended
    assert victim.returncode == 1 and "LockLostError" in out_v, out_v[-3000:]
    keys = [invoice["idempotency_key"] for invoice in invoices]
    assert len(keys) == 200 and len(set(keys)) == 200, len(keys)
    assert rows(
        local, "SELECT status, count(*) FROM idempotency.outbound_ledger GROUP BY status"
    ) == [("succeeded", 200)]
    ((successor_attempt,),) = rows(
        local, "SELECT attempt_id FROM idempotency.job_run_attempts WHERE outcome = 'completed'"
    )
    # Every effect but the first batch (the cut-off worker's, confirmed before the cut) was
    # claimed and confirmed by the successor: the open claim of the cut-off worker never landed.
    first_batch = [f"core_export:2026-10-01:{i}" for i in range(1, 21)]
    with psycopg.connect(local) as conn:
        others = conn.execute(
            "SELECT count(*) FROM idempotency.outbound_ledger"
            " WHERE last_attempt_id <> %s AND NOT (idempotency_key = ANY(%s))",
            (successor_attempt, first_batch),
        ).fetchone()
    assert others == (0,)
    assert requests_at_end["requests"] == requests_after_successor["requests"]
    figures(
        f"link cut with a ledger batch's claim open (20 of 200 effects confirmed): the server "
        f"ended the claim {ended:.1f} s after the cut (bound {BOUND} s); a successor sent the "
        f"other 180 under the same keys and completed {taken_over:.1f} s after the cut; the "
        "remote holds 200 invoices, one per key, and received no request after the successor "
        "finished"
    )
