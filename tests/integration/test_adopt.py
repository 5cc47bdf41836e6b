"""``adopt`` (docs/adopt.md) on real DAG runs and a real job database, on both lines: the
plan writes nothing; --apply records the keys of succeeded runs as completed, naming the
run; the policy then leaves them alone; keys recorded or locked are left as they are.

Airflow 3's REST API is read end to end in tests/stack/test_policy_stack.py; here the runs
come from Airflow 2's metadata database, or (3.x) from the DagRuns dag.test() returns.
"""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path
from typing import Any

import pendulum
import psycopg
import pytest

from airflow_idempotency import adoption
from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS
from airflow_idempotency.locks import run_lock_key
from airflow_idempotency.schema import ensure_schema
from support import TESTS
from support.cli import cli, record
from support.dag_runs import SUCCESS, load_dag_bag, run_dag, scheduled_logical_date
from support.db import rows

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]


def _fire(business_date: str) -> Any:
    """The logical date of the scheduled run of ``business_date`` (0 1 * * *), this line's."""
    return pendulum.parse(scheduled_logical_date(business_date))


DAY = dt.timedelta(days=1)


@pytest.fixture
def work_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "work.log"
    path.touch()
    monkeypatch.setenv("POLICY_WORK_LOG", str(path))
    return path


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "dags"
    folder.mkdir(exist_ok=True)
    shutil.copy(TESTS / "dags_policy" / "nightly_sales.py", folder)
    return folder


def _dag(folder: Path) -> Any:
    bag = load_dag_bag(folder)
    assert not bag.import_errors, bag.import_errors
    return bag.dags["nightly_sales"]


def _history(folder: Path, days: list[str]) -> list[adoption.SucceededRun]:
    """Runs of ``days`` made before the policy (its setting unset): Airflow's record only."""
    dag = _dag(folder)
    made = []
    for day in days:
        run = run_dag(dag, _fire(day))
        assert run.state == SUCCESS
        made.append(run)
    if not AIRFLOW_V_3_0_PLUS:
        # Airflow's metadata database is shared by the session's tests (test_policy.py
        # runs this DAG too): the runs made here, as metadata_runs reads them.
        first = min(r.logical_date for r in made)
        ours = {r.run_id for r in made}
        read = adoption.metadata_runs("nightly_sales", first, first + 10 * DAY)
        return [r for r in read if r.run_id in ours]
    return [
        adoption.SucceededRun(
            run_id=r.run_id,
            run_type=str(getattr(r.run_type, "value", r.run_type)),
            logical_date=r.logical_date,
            end_date=r.end_date,
            conf=dict(r.conf or {}),
        )
        for r in made
    ]


def test_adopted_history_is_left_alone_by_the_policy(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _folder(tmp_path)
    runs = _history(folder, ["2026-10-01", "2026-10-02"])
    assert len(runs) == 2 and len(work_log.read_text().splitlines()) == 6
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", "nightly")
    dag = _dag(folder)

    planned = adoption.plan(dag, runs, None, "idempotency")
    assert sorted((a.job_name, a.run_key, a.would) for a in planned) == [
        (f"nightly_sales.{t}", k, "adopt")
        for t in ("extract", "load")
        for k in ("2026-10-01", "2026-10-02")
    ]
    assert rows(airflow_pg_conn, "SELECT to_regclass('idempotency.job_runs')") == [(None,)]

    record(airflow_pg_conn, "nightly_sales.extract", "2026-10-02", fail=True)  # a failed rerun
    with psycopg.connect(airflow_pg_conn, autocommit=True) as conn:
        planned = adoption.plan(dag, runs, conn, "idempotency")
        adoption.apply(conn, "idempotency", "nightly_sales", planned)
    outcome = {(a.job_name, a.run_key): a.would for a in planned}
    assert outcome.pop(("nightly_sales.extract", "2026-10-02")) == "recorded"
    assert set(outcome.values()) == {"adopted"}
    recorded = rows(
        airflow_pg_conn,
        "SELECT job_name, run_key, status, triggered_by, run_id = details->'adopted_from'->>'run_id'"
        " FROM idempotency.job_runs ORDER BY 1, 2",
    )
    assert recorded == [
        ("nightly_sales.extract", "2026-10-01", "completed", "adopted", True),
        ("nightly_sales.extract", "2026-10-02", "failed", "unknown", None),
        ("nightly_sales.load", "2026-10-01", "completed", "adopted", True),
        ("nightly_sales.load", "2026-10-02", "completed", "adopted", True),
    ]

    work_log.write_text("")
    for day in ("2026-10-01", "2026-10-02"):
        assert run_dag(dag, _fire(day)).state == SUCCESS
    # load adopted both days: no work; extract's failed key runs (once); notify is exempt.
    done = sorted(line.split()[0] for line in work_log.read_text().splitlines())
    assert done == ["extract", "notify", "notify"]


def test_a_locked_key_and_a_duplicate_run_are_not_adopted(
    airflow_pg_conn: str, work_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key whose run lock is held (a run in progress) is left alone, and of two succeeded
    runs of one key only the one that ended last is recorded."""
    folder = _folder(tmp_path)
    (run,) = _history(folder, ["2026-10-03"])
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", "nightly")
    dag = _dag(folder)
    assert run.end_date is not None
    later = adoption.SucceededRun(
        "manual__later", "manual", None, run.end_date + DAY, {"run_key": "2026-10-03"}
    )
    with (
        psycopg.connect(airflow_pg_conn, autocommit=True) as conn,
        psycopg.connect(airflow_pg_conn, autocommit=True) as holder,
    ):
        ensure_schema(conn, "idempotency")
        holder.execute(
            "SELECT pg_advisory_lock(%s)", (run_lock_key("nightly_sales.load", "2026-10-03"),)
        )
        planned = adoption.plan(dag, [run, later], conn, "idempotency")
        adoption.apply(conn, "idempotency", "nightly_sales", planned)
    outcome = sorted((a.job_name, a.run.run_id == run.run_id, a.would) for a in planned)
    assert outcome == [
        ("nightly_sales.extract", False, "adopted"),
        ("nightly_sales.extract", True, "duplicate"),
        ("nightly_sales.load", False, "locked"),
        ("nightly_sales.load", True, "duplicate"),
    ]
    assert rows(airflow_pg_conn, "SELECT job_name, run_id FROM idempotency.job_runs") == [
        ("nightly_sales.extract", "manual__later")
    ]


def test_the_command_refuses_bad_input_and_writes_nothing(
    airflow_pg_conn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path)
    base = ["adopt", "nightly_sales", "--dsn", airflow_pg_conn, "--dags-folder", str(folder)]
    code, _, err = cli(capsys, *base, "--from", "2026-10-05", "--to", "2026-10-01")
    assert code == 2 and "--from 2026-10-05 is after --to 2026-10-01" in err
    # The policy's tag is not configured: no task of the DAG is protected.
    code, _, err = cli(capsys, *base, "--from", "2026-10-01", "--to", "2026-10-02", "--apply")
    assert code == 2 and "no task under the contract" in err and "policy_dag_tags" in err
    code, _, err = cli(capsys, *base, "--from", "2026-10-1", "--to", "2026-10-02")
    assert code == 2 and "argument --from: '2026-10-1' is not a date" in err
    secret = "http://admin:s3cret@airflow:8080"
    code, _, err = cli(
        capsys, *base, "--from", "2026-10-01", "--to", "2026-10-02", "--api-url", secret
    )
    assert code == 2 and "argument --api-url: holds credentials" in err and "s3cret" not in err
    assert rows(airflow_pg_conn, "SELECT to_regclass('idempotency.job_runs')") == [(None,)]


def test_an_adopted_key_records_its_zone_and_keeps_to_the_zone_rule(
    airflow_pg_conn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adopted key records the zone it was made in (the DAG's, UTC), as a run's does; a
    job whose recorded keys were made in another zone has nothing adopted (refused, naming
    both zones), as a run of it would be refused."""
    monkeypatch.setenv("AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS", "nightly")
    dag = _dag(_folder(tmp_path))
    runs = [
        adoption.SucceededRun(f"scheduled__{day}", "scheduled", _fire(day), _fire(day) + DAY)
        for day in ("2026-10-06", "2026-10-07")
    ]
    record(airflow_pg_conn, "nightly_sales.load", "2026-09-01")
    with psycopg.connect(airflow_pg_conn, autocommit=True) as conn:
        conn.execute(
            "UPDATE idempotency.job_runs SET key_zone = 'Europe/Amsterdam'"
            " WHERE job_name = 'nightly_sales.load'"
        )
        planned = adoption.plan(dag, runs, conn, "idempotency")
        adoption.apply(conn, "idempotency", "nightly_sales", planned)
    outcome = sorted((a.job_name, a.run_key, a.would) for a in planned)
    assert outcome == [
        ("nightly_sales.extract", "2026-10-06", "adopted"),
        ("nightly_sales.extract", "2026-10-07", "adopted"),
        ("nightly_sales.load", "2026-10-06", "refused"),
        ("nightly_sales.load", "2026-10-07", "refused"),
    ]
    refusal = next(a.reason for a in planned if a.would == "refused")
    assert "made in the timezone UTC" in refusal and "Europe/Amsterdam" in refusal
    assert rows(
        airflow_pg_conn,
        "SELECT job_name, run_key, key_zone FROM idempotency.job_runs ORDER BY 1, 2",
    ) == [
        ("nightly_sales.extract", "2026-10-06", "UTC"),
        ("nightly_sales.extract", "2026-10-07", "UTC"),
        ("nightly_sales.load", "2026-09-01", "Europe/Amsterdam"),
    ]
