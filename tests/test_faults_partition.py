"""A worker cut off from Postgres by the network, for real: its own network namespace.

The worker runs ``airflow dags test`` inside a namespace whose only way to the job database
is a veth pair; the database is a private server listening on the host side of it. Taking
the link down drops every packet, with no FIN and no reset: each end learns of it only from
TCP keepalives and the user timeout (locks.DEAD_PEER_DEFAULTS, set on both ends of the lock
session). With Linux's defaults the server would keep the dead worker's lock for over two
hours. Needs root and iproute2.
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
from fault_support import advisory_locks, figures
from workers import (
    TEST_DAGS,
    dags_test,
    kill_group,
    private_airflow_env,
    start_worker,
    wait_until,
)

# Every scenario runs Airflow workers: on both lines (core_slow_job's timetable is explicit).
pytestmark = pytest.mark.both_airflow_lines

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


def rows(dsn: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql).fetchall()


def work_log(dsn: str) -> list[tuple[int, str]]:
    if not rows(dsn, "SELECT to_regclass('public.work_log') IS NOT NULL")[0][0]:
        return []
    return rows(dsn, "SELECT pid, phase FROM public.work_log ORDER BY at")


def cut_off_worker(
    link: netns.Link, airflow_home: Path, dsn: str, tmp_path: Path, **env: str
) -> subprocess.Popen[str]:
    """`airflow dags test core_slow_job` inside the namespace, reaching the job DB over the link."""
    worker_env = private_airflow_env(airflow_home, dsn, TEST_DAGS, home=tmp_path / "cut-off")
    worker_env.update(env)
    return dags_test(worker_env, "core_slow_job", DAY, prefix=link.run_prefix())


def test_the_server_frees_a_cut_off_workers_lock_and_its_late_writes_are_fenced(
    link: netns.Link, server: tuple[netns.TcpPostgres, str], airflow_home: Path, tmp_path: Path
) -> None:
    """Link cut mid-work: Postgres frees the lock within the bound, a second worker takes the
    key over and completes it; when the link returns, the cut-off worker's last write is
    refused (fenced), it fails its attempt cleanly, and the key stays completed, once."""
    pg, name = server
    local, remote = pg.local_dsn(name), pg.dsn(name)
    release = tmp_path / "release"
    victim = cut_off_worker(
        link,
        airflow_home,
        remote,
        tmp_path,
        IDEM_TEST_HOLD_FILE=str(release),
        IDEM_TEST_HOLD_MAX="600",
        IDEM_TEST_WRITE_AFTER_HOLD="1",
    )
    successor = None
    try:
        wait_until(
            lambda: len(work_log(local)) == 1, timeout=120, what="the worker to start working"
        )
        assert advisory_locks(local) == 1
        link.cut()
        cut_at = time.monotonic()
        # The successor runs on this side, rescheduling every second while the key is held.
        # Its output goes to a file: it logs ~1.5 kB a second, which fills a pipe nobody
        # reads within a minute and then blocks it (seen: it hung before the lock was freed).
        successor_log = tmp_path / "successor.log"
        successor_env = private_airflow_env(airflow_home, local, TEST_DAGS, home=tmp_path / "s")
        successor_env.update(
            {"IDEM_TEST_ON_LOCKED": "reschedule", "IDEM_TEST_WRITE_AFTER_HOLD": "1"}
        )
        with successor_log.open("w") as log:
            successor = dags_test(successor_env, "core_slow_job", DAY, output=log)
        wait_until(
            lambda: advisory_locks(local) == 0 or None,
            timeout=BOUND + 30,
            interval=0.2,
            what="the lock to be freed",
        )
        freed = time.monotonic() - cut_at
        try:
            wait_until(
                lambda: (
                    rows(local, "SELECT status FROM idempotency.job_runs") == [("completed",)]
                    or None
                ),
                timeout=120,
                interval=0.2,
                what="the successor to complete the key",
            )
        except AssertionError as exc:
            kill_group(successor)
            out_s = successor_log.read_text(errors="replace")
            attempts = rows(
                local,
                "SELECT attempt_id, pid, outcome, error FROM idempotency.job_run_attempts"
                " ORDER BY attempt_id",
            )
            raise AssertionError(
                f"{exc}\nattempts: {attempts}\nthe successor's output:\n{out_s[-6000:]}"
            ) from None
        taken_over = time.monotonic() - cut_at
        successor.wait(timeout=120)
        assert successor.returncode == 0, successor_log.read_text(errors="replace")[-3000:]
        link.restore()
        release.touch()
        out_v, _ = victim.communicate(timeout=180)
    finally:
        release.touch()
        link.restore()
        kill_group(victim)
        if successor is not None:
            kill_group(successor)
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
    assert rows(
        local, "SELECT status, current_attempt_id IS NOT NULL FROM idempotency.job_runs"
    ) == [("completed", True)]
    assert advisory_locks(local) == 0
    figures(
        f"link cut mid-work: Postgres freed the lock after {freed:.1f} s (bound {BOUND} s), a "
        f"second worker had completed the key {taken_over:.1f} s after the cut; after the link "
        "returned, the cut-off worker's fenced write was refused (LockLostError), 0 rows "
        "written after the cut"
    )


def test_a_cut_off_worker_notices_within_the_bound(
    link: netns.Link, server: tuple[netns.TcpPostgres, str], airflow_home: Path, tmp_path: Path
) -> None:
    """Link cut while the work is about to commit: the worker's statement hangs on the dead
    link only until the client's TCP user timeout, the task fails, and after the link
    returns a rerun takes the abandoned key over and completes it."""
    pg, name = server
    local, remote = pg.local_dsn(name), pg.dsn(name)
    release = tmp_path / "release"
    victim = cut_off_worker(
        link,
        airflow_home,
        remote,
        tmp_path,
        IDEM_TEST_HOLD_FILE=str(release),
        IDEM_TEST_HOLD_MAX="600",
        IDEM_TEST_WRITE_AFTER_HOLD="1",
    )
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
