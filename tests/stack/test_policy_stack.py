"""The cluster policy and ``adopt`` end to end, with Airflow's own processes, on both lines
(docs/policy.md, docs/adopt.md).

One DAG written without the provider (tests/dags_policy/nightly_sales.py). First without the
policy's tag: a backfill does its work, Airflow alone records it. Then tagged: ``adopt``
plans and records that history; triggered twice and backfilled twice, each date's work runs
once, and the adopted dates not at all. Each task that does work writes a line to a log
file: the lines are what really ran.
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS
from devtools.airflow_env import connection_env
from support import TESTS
from support.cli import cli_process_with
from support.db import rows
from support.workers import private_airflow_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("airflow_home")]

TAGGED = 'tags=["nightly", "sales"]'
UNTAGGED = 'tags=["sales"]'


def dags_folder(tmp_path: Path, tagged: bool) -> Path:
    folder = tmp_path / "dags"
    folder.mkdir(exist_ok=True)
    text = (TESTS / "dags_policy" / "nightly_sales.py").read_text()
    assert TAGGED in text
    (folder / "nightly_sales.py").write_text(text if tagged else text.replace(TAGGED, UNTAGGED))
    return folder


def policy_env(work_log: Path) -> dict[str, str]:
    return {"AIRFLOW__IDEMPOTENCY__POLICY_DAG_TAGS": "nightly", "POLICY_WORK_LOG": str(work_log)}


def work_done(work_log: Path, task: str) -> collections.Counter[str]:
    """How many times ``task`` did its work, per logical date (ds)."""
    lines = work_log.read_text().splitlines() if work_log.exists() else []
    return collections.Counter(ds for t, ds in (line.split() for line in lines) if t == task)


def adopt(env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    proc = cli_process_with(env, "adopt", "nightly_sales", *args, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def job_runs(dsn: str) -> list[tuple[Any, ...]]:
    return rows(
        dsn,
        "SELECT job_name, run_key, status, triggered_by, run_id,"
        " details->'adopted_from'->>'run_id' FROM idempotency.job_runs ORDER BY 1, 2",
    )


def check_adoption(dsn: str, env: dict[str, str], first: str, last: str, keys: list[str]) -> None:
    """adopt's plan writes nothing; --apply records every key of both tasks, naming its run;
    a second --apply finds them recorded."""
    plan = adopt(env, "--from", first, "--to", last, "--dsn", dsn)
    assert {(r["job_name"], r["run_key"], r["would"]) for r in plan} == {
        (f"nightly_sales.{t}", k, "adopt") for t in ("extract", "load") for k in keys
    }
    assert rows(dsn, "SELECT to_regclass('idempotency.job_runs')") == [(None,)]
    applied = adopt(env, "--from", first, "--to", last, "--dsn", dsn, "--apply")
    assert {r["would"] for r in applied} == {"adopted"}
    recorded = job_runs(dsn)
    assert [(j, k, s, t) for j, k, s, t, _, _ in recorded] == [
        (f"nightly_sales.{t}", k, "completed", "adopted") for t in ("extract", "load") for k in keys
    ]
    assert all(run_id and run_id == source for *_, run_id, source in recorded)
    again = adopt(env, "--from", first, "--to", last, "--dsn", dsn, "--apply")
    assert {r["would"] for r in again} == {"recorded"}


@pytest.mark.skipif(
    not AIRFLOW_V_3_0_PLUS, reason="Airflow 3: scheduler, api-server, backfill create"
)
def test_policy_and_adopt_on_airflow3(pg_dsn: str, tmp_path: Path) -> None:
    from devtools.airflow_stack import airflow_stack

    work_log = tmp_path / "work.log"
    folder = dags_folder(tmp_path, tagged=False)
    env = {**connection_env(pg_dsn), **policy_env(work_log)}
    with airflow_stack(tmp_path / "home", folder, extra_env=env) as stack:
        stack.unpause("nightly_sales")
        # Untagged: plain Airflow. Fire times D+1 01:00 process business days 10-01, 10-02.
        history = stack.backfill(
            "nightly_sales", "2026-10-02T01:00:00+00:00", "2026-10-03T01:00:00+00:00"
        )
        assert [r.state for r in history] == ["success"] * 2
        dags_folder(tmp_path, tagged=True)
        stack.wait_for_dag("nightly_sales", reserialize=True)
        cli_env = {**stack.env, "AIRFLOW_IDEMPOTENCY_API_URL": stack.base_url}
        check_adoption(pg_dsn, cli_env, "2026-10-02", "2026-10-03", ["2026-10-01", "2026-10-02"])

        # Triggered twice for business day 10-04: by its logical date, then by its key.
        first = stack.trigger("nightly_sales", "2026-10-05T01:00:00+00:00")
        second = stack.trigger("nightly_sales", conf={"run_key": "2026-10-04"})
        assert (first.state, second.state) == ("success", "success")
        # Backfilled twice: the adopted days and two new ones.
        for behavior in ("none", "completed"):
            runs = stack.backfill(
                "nightly_sales", "2026-10-02T01:00:00+00:00", "2026-10-07T01:00:00+00:00",
                reprocess_behavior=behavior, timeout=600,
            )  # fmt: skip
            assert {r.state for r in runs} == {"success"}, stack.describe_runs(
                "nightly_sales", [r.run_id for r in runs]
            )
    # Logical dates 10-02..10-07 (business days 10-01..10-06): each did its work once.
    once = {f"2026-10-0{d}": 1 for d in range(2, 8)}
    assert work_done(work_log, "extract") == once
    assert work_done(work_log, "load") == once
    assert sum(work_done(work_log, "notify").values()) > 5  # exempt: runs every time


@pytest.mark.airflow2_only
def test_policy_and_adopt_on_airflow2(pg_dsn: str, airflow_home: Path, tmp_path: Path) -> None:
    work_log = tmp_path / "work.log"
    folder = dags_folder(tmp_path, tagged=False)
    env = private_airflow_env(airflow_home, pg_dsn, folder, home=tmp_path / "home")
    env.update(policy_env(work_log))

    def airflow(*args: str) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "airflow", *args], env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, (args, proc.stdout[-3000:], proc.stderr[-3000:])

    # Untagged: plain Airflow. On 2.11 the logical date of business day D is D 01:00 (a
    # bare -e date is its midnight: the bounds name the runs' logical dates).
    airflow(
        "dags", "backfill", "-s", "2026-10-01", "-e", "2026-10-02T01:00:00+00:00", "nightly_sales"
    )
    dags_folder(tmp_path, tagged=True)
    check_adoption(pg_dsn, env, "2026-10-01", "2026-10-02", ["2026-10-01", "2026-10-02"])

    for _ in range(2):  # triggered twice (dags test: a manual run, in this process)
        airflow("dags", "test", "nightly_sales", "2026-10-04T01:00:00+00:00")
    for flags in ((), ("--reset-dagruns", "-y")):  # backfilled twice, then really rerun
        airflow(
            "dags", "backfill", "-s", "2026-10-01", "-e", "2026-10-06T01:00:00+00:00", *flags,
            "nightly_sales",
        )  # fmt: skip
    once = {f"2026-10-0{d}": 1 for d in (1, 2, 3, 4, 5, 6)}
    assert work_done(work_log, "extract") == once
    assert work_done(work_log, "load") == once
    shutil.rmtree(tmp_path / "home", ignore_errors=True)
