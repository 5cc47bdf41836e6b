"""Airflow 2.11's own ways of running dates: ``airflow dags backfill`` and the 2.x scheduler.

Run by ``python3 dev.py test --airflow 2`` (deselected on Airflow 3, which has no
``dags backfill``). ``dags backfill`` runs in the CLI process itself (SequentialExecutor on
SQLite, each task an ``airflow tasks run`` subprocess), without a scheduler. The example
DAGs use a cron string, so on Airflow 2 their timetable is CronDataIntervalTimetable: the
run for business date D has logical date D (its interval's start), run key D.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devtools.airflow_env import DAGS_FOLDER
from devtools.workers import start_airflow
from support.db import rows
from support.locks import advisory_locks
from support.workers import kill_group, private_airflow_env, wait_until

pytestmark = [
    pytest.mark.airflow2_only,
    pytest.mark.usefixtures("airflow_home"),
]

RECONCILE = "daily_reconciliation"
PASTED = "daily_reconciliation_pasted_twice"


def home_env(
    airflow_home: Path, invoicing: Any, tmp_path: Path, name: str, **extra: Any
) -> dict[str, str]:
    """A private Airflow 2 home on the example dags/, with the example's connections."""
    env = private_airflow_env(airflow_home, invoicing.dsn, DAGS_FOLDER, home=tmp_path / name)
    env.update(invoicing.connection_env(**extra))
    return env


def airflow(
    env: dict[str, str], *args: str, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "airflow", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def backfill_process(
    env: dict[str, str], dag_id: str, start: str, end: str, *flags: str
) -> subprocess.Popen[str]:
    return start_airflow(env, "dags", "backfill", "-s", start, "-e", end, *flags, dag_id)


def backfill(
    env: dict[str, str], dag_id: str, start: str, end: str, *flags: str
) -> tuple[int, str]:
    proc = backfill_process(env, dag_id, start, end, *flags)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    return proc.returncode, out


def attempts(dsn: str, job: str) -> list[tuple[str, str, str, str]]:
    """(run_key, dag_id, outcome, triggered_by) of a job's attempts, in order."""
    return rows(
        dsn,
        "SELECT run_key, dag_id, outcome, triggered_by FROM idempotency.job_run_attempts"
        " WHERE job_name = %s ORDER BY attempt_id",
        (job,),
    )


def summaries(dsn: str) -> list[tuple[str, int]]:
    return [
        (str(day), runs)
        for day, runs in rows(
            dsn, "SELECT business_date, runs FROM reconciliation_summary ORDER BY business_date"
        )
    ]


def test_dags_backfill_twice_works_once_per_date(
    airflow_home: Path, invoicing: Any, tmp_path: Path
) -> None:
    """`airflow dags backfill` over three dates, then again with --reset-dagruns: each date's
    work runs once, every task of the second pass is a recorded no-op.

    The bounds are compared with logical dates: for this 01:30 cron a bare `-e 2026-10-03`
    is midnight and stops at business date 10-02; `-e 2026-10-03T01:30:00+00:00` includes
    10-03 (and a backfill skips the dates it already ran).
    """
    invoicing.seed("2026-10-01", "2026-10-03", orders=20)
    env = home_env(airflow_home, invoicing, tmp_path, "home")
    code, out = backfill(env, RECONCILE, "2026-10-01", "2026-10-03")
    assert code == 0, out[-4000:]
    assert [day for day, _ in summaries(invoicing.dsn)] == ["2026-10-01", "2026-10-02"]
    code, out = backfill(env, RECONCILE, "2026-10-01", "2026-10-03T01:30:00+00:00")
    assert code == 0, out[-4000:]
    code, out = backfill(
        env, RECONCILE, "2026-10-01", "2026-10-03T01:30:00+00:00", "--reset-dagruns", "-y"
    )
    assert code == 0, out[-4000:]
    days = ("2026-10-01", "2026-10-02", "2026-10-03")
    assert attempts(invoicing.dsn, RECONCILE) == [
        *((day, RECONCILE, "completed", "backfill") for day in days),
        *((day, RECONCILE, "noop", "backfill") for day in days),
    ]
    assert summaries(invoicing.dsn) == [(day, 1) for day in days]
    assert advisory_locks(invoicing.dsn) == 0


def test_failed_date_then_rerun_failed_tasks_completes_it(
    airflow_home: Path, invoicing: Any, tmp_path: Path
) -> None:
    """The accounting service refuses every call: the export fails the backfill (its retries
    used); `--rerun-failed-tasks` after it recovers completes the date, one invoice per order."""
    invoicing.seed("2026-10-01", orders=25)
    env = home_env(airflow_home, invoicing, tmp_path, "home", max_attempts=2)
    invoicing.service.set_faults(fail_rate=1.0)
    code, out = backfill(env, "finalize_invoices", "2026-10-01", "2026-10-01T01:00:00+00:00")
    assert code == 1, out[-4000:]
    assert invoicing.service.stats()["invoices"] == 0
    export = "finalize_invoices.export_invoices"
    assert [o for _, _, o, _ in attempts(invoicing.dsn, export)] == ["failed"] * 3  # retries=2
    invoicing.service.set_faults(fail_rate=0.0)
    # Without --rerun-failed-tasks a backfill leaves the failed task alone (and fails again).
    code, out = backfill(env, "finalize_invoices", "2026-10-01", "2026-10-01T01:00:00+00:00")
    assert code == 1, out[-4000:]
    code, out = backfill(
        env, "finalize_invoices", "2026-10-01", "2026-10-01T01:00:00+00:00", "--rerun-failed-tasks"
    )
    assert code == 0, out[-4000:]
    state = invoicing.state("2026-10-01")
    assert len(state["invoices"]) == 25 and len(state["remote"]) == 25
    assert state["remote_duplicate_orders"] == []
    assert [s for _, s, _ in state["ledger"]] == ["succeeded"] * 25
    assert [o for _, _, o, _ in attempts(invoicing.dsn, export)] == ["failed"] * 3 + ["completed"]
    # create_invoices and rebuild_totals had succeeded: the rerun did not touch them.
    assert [o for _, _, o, _ in attempts(invoicing.dsn, "finalize_invoices.create_invoices")] == [
        "completed"
    ]


def test_overlapping_backfills_of_the_pasted_pair_work_once_per_date(
    airflow_home: Path, invoicing: Any, tmp_path: Path
) -> None:
    """Two backfills at once, of the two DAGs that share a job, over overlapping ranges: each
    date's work runs once; on the shared dates the other side waits or finds it done."""
    invoicing.seed("2026-10-01", "2026-10-04", orders=10)
    first = backfill_process(
        home_env(airflow_home, invoicing, tmp_path, "a"),
        RECONCILE,
        "2026-10-01",
        "2026-10-03T01:30:00+00:00",
    )
    second = backfill_process(
        home_env(airflow_home, invoicing, tmp_path, "b"),
        PASTED,
        "2026-10-02",
        "2026-10-04T01:30:00+00:00",
    )
    try:
        out1, _ = first.communicate(timeout=600)
        out2, _ = second.communicate(timeout=600)
    finally:
        kill_group(first)
        kill_group(second)
    assert (first.returncode, second.returncode) == (0, 0), out1[-3000:] + out2[-3000:]
    by_date: dict[str, list[tuple[str, str]]] = {}
    for day, dag_id, outcome, _ in attempts(invoicing.dsn, RECONCILE):
        by_date.setdefault(day, []).append((dag_id, outcome))
    for day in ("2026-10-01", "2026-10-02", "2026-10-03", "2026-10-04"):
        outcomes = [o for _, o in by_date[day]]
        assert outcomes.count("completed") == 1, (day, by_date[day])
        assert set(outcomes) <= {"completed", "noop", "lock_held"}, (day, by_date[day])
    for day in ("2026-10-02", "2026-10-03"):  # both DAGs ran these dates
        assert {d for d, _ in by_date[day]} == {RECONCILE, PASTED}, by_date[day]
        assert [o for _, o in by_date[day]][-1] == "noop", by_date[day]
    assert summaries(invoicing.dsn) == [(f"2026-10-0{d}", 1) for d in (1, 2, 3, 4)]


def test_worker_killed_mid_work_then_rerun_converges(
    airflow_home: Path, invoicing: Any, tmp_path: Path
) -> None:
    """The task process is SIGKILLed after its run started: the backfill fails, the key says
    started and its lock is gone; a rerun of the failed task takes it over and completes it."""
    invoicing.seed("2026-10-01", orders=10)
    env = home_env(airflow_home, invoicing, tmp_path, "home")
    crashed = {**env, "AIRFLOW_IDEMPOTENCY_CRASH_AT": "runner.after_started"}
    code, out = backfill(crashed, RECONCILE, "2026-10-01", "2026-10-01T01:30:00+00:00")
    assert code == 1, out[-4000:]  # the task process died (its log says at which point)
    assert rows(invoicing.dsn, "SELECT status FROM idempotency.job_runs") == [("started",)]
    assert advisory_locks(invoicing.dsn) == 0
    code, out = backfill(
        env, RECONCILE, "2026-10-01", "2026-10-01T01:30:00+00:00", "--rerun-failed-tasks"
    )
    assert code == 0, out[-4000:]
    assert rows(invoicing.dsn, "SELECT status, attempt_count FROM idempotency.job_runs") == [
        ("completed", 2)
    ]
    outcomes = rows(
        invoicing.dsn, "SELECT outcome, error FROM idempotency.job_run_attempts ORDER BY attempt_id"
    )
    assert [o for o, _ in outcomes] == ["lock_lost", "completed"]
    assert outcomes[0][1].startswith("abandoned")
    assert summaries(invoicing.dsn) == [("2026-10-01", 1)]


def test_manual_trigger_with_run_key_through_the_scheduler(
    airflow_home: Path, invoicing: Any, tmp_path: Path
) -> None:
    """`airflow dags trigger -c '{"run_key": ...}'` run by a real Airflow 2 scheduler processes
    that business date, whatever the trigger's logical date (now), recorded as manual."""
    invoicing.seed("2026-10-05", orders=10)
    env = home_env(airflow_home, invoicing, tmp_path, "home")
    env["AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE"] = "False"  # only the run we trigger
    env["AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC"] = "1"
    serialized = airflow(env, "dags", "reserialize")  # `dags trigger` needs the DagModel row
    assert serialized.returncode == 0, serialized.stdout + serialized.stderr
    unpaused = airflow(env, "dags", "unpause", RECONCILE)
    assert unpaused.returncode == 0, unpaused.stdout + unpaused.stderr
    log = open(tmp_path / "scheduler.log", "w")  # noqa: SIM115 - closed below
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "airflow", "scheduler"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        triggered = airflow(
            env, "dags", "trigger", RECONCILE, "-c", json.dumps({"run_key": "2026-10-05"})
        )
        assert triggered.returncode == 0, triggered.stdout + triggered.stderr
        wait_until(
            lambda: (
                rows(
                    invoicing.dsn,
                    "SELECT status FROM idempotency.job_runs WHERE run_key = '2026-10-05'"
                    " AND to_regclass('idempotency.job_runs') IS NOT NULL",
                )
                if rows(invoicing.dsn, "SELECT to_regclass('idempotency.job_runs') IS NOT NULL")[0][
                    0
                ]
                else []
            ),
            timeout=240,
            interval=1,
            what="the scheduler to run the triggered date",
        )
        wait_until(
            lambda: (
                rows(invoicing.dsn, "SELECT status FROM idempotency.job_runs") == [("completed",)]
            ),
            timeout=120,
            interval=1,
            what="the triggered run to complete",
        )
    finally:
        kill_group(scheduler)
        log.close()
    assert attempts(invoicing.dsn, RECONCILE) == [("2026-10-05", RECONCILE, "completed", "manual")]
    assert summaries(invoicing.dsn) == [("2026-10-05", 1)]  # nothing else ran
