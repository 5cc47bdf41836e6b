"""The real-Airflow tooling of devtools/airflow_stack/: scheduler, api-server, dag-processor."""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from datetime import date
from pathlib import Path
from typing import Any

import psutil
import pytest

from devtools.airflow_stack import airflow_stack, run_id_from_trigger_output
from support import TESTS

DAGS = TESTS / "dags_stack"


def test_trigger_output_parsing() -> None:
    """The run id is read from the JSON line that `airflow dags trigger -o json` prints after its logs."""
    out = (
        "2026-11-29T08:50:49Z [info] creating dag run run_id=manual__x\n"
        '[{"conf": {"a": "1"}, "dag_id": "d", "dag_run_id": "manual__2026", "state": "queued"}]\n'
    )
    assert run_id_from_trigger_output(out) == "manual__2026"


def _home_processes(home: Path) -> list[psutil.Process]:
    """Processes whose environment (as far as still readable) names ``home`` as AIRFLOW_HOME."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("AIRFLOW_HOME") == str(home) and proc.status() != "zombie":
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.mark.slow
def test_backfill_then_reprocess_completed(tmp_path: Path) -> None:
    """A real stack runs a 3-date backfill, reruns it with reprocess "completed", and leaves no process."""
    out = tmp_path / "lines.txt"
    home = tmp_path / "home"
    t0 = time.monotonic()
    with airflow_stack(home, DAGS, extra_env={"STACK_PROBE_OUT": str(out)}) as stack:
        t_up = time.monotonic()
        stack.unpause("stack_probe")
        t1 = time.monotonic()
        first = stack.backfill("stack_probe", "2026-10-01", "2026-10-03")
        t2 = time.monotonic()
        second = stack.backfill(
            "stack_probe", date(2026, 10, 1), date(2026, 10, 3), reprocess_behavior="completed"
        )
        t3 = time.monotonic()

        dates = [date(2026, 10, d) for d in (1, 2, 3)]
        assert [(r.logical_date.date() if r.logical_date else None) for r in first] == dates
        assert {(r.state, r.run_type, r.clear_number) for r in first} == {
            ("success", "backfill", 0)
        }
        # "completed" clears and reruns the same runs rather than creating new ones.
        assert [r.run_id for r in second] == [r.run_id for r in first]
        # Cleared at least once (twice when `backfill create` hit "database is locked" on
        # SQLite after clearing and was retried: seen on a heavily loaded machine).
        assert {(r.state, r.run_type) for r in second} == {("success", "backfill")}
        assert all(r.clear_number >= 1 for r in second)
        for run in second:
            [ti] = stack.task_instances("stack_probe", run.run_id)
            assert (ti.task_id, ti.state) == ("write_line", "success") and ti.try_number >= 2
        # USE_JOB_SCHEDULE=False: unpausing created no scheduled__<today> run.
        assert [r.run_id for r in stack.dag_runs("stack_probe")] == [r.run_id for r in first]

        components = [psutil.Process(p.pid) for p in stack.procs.values()]
        tree = {psutil.Process(i.pid) for i in stack.tree() if psutil.pid_exists(i.pid)}
        for proc in components:
            tree.update(proc.children(recursive=True))
        assert len(tree) >= len(components)
        print(
            f"\nstack timings: set-up {t_up - t0:.1f}s {stack.timings}, unpause {t1 - t_up:.1f}s, "
            f"backfill {t2 - t1:.1f}s, reprocess backfill {t3 - t2:.1f}s"
        )

    lines = out.read_text(encoding="utf-8").splitlines()
    per_run = Counter(line.split()[0] for line in lines)
    assert set(per_run) == {r.run_id for r in first} and min(per_run.values()) >= 2
    assert [p for p in tree if p.is_running() and p.status() != "zombie"] == []
    assert _home_processes(home.resolve()) == []


@pytest.mark.slow
def test_backfill_recovers_from_a_create_that_failed_half_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `backfill create` that fails after committing its backfill and runs (SQLite's
    "database is locked", seen in CI) does not leave the helper waiting on "Another backfill
    is running" with the DAG paused: the half-made backfill's runs finish, it is closed,
    and the create runs again.

    The failure itself cannot be provoked on demand, so the first attempt is the real
    command with its exit status replaced, which leaves exactly that state.
    """
    home = tmp_path / "home"
    with airflow_stack(home, DAGS, extra_env={"STACK_PROBE_OUT": str(tmp_path / "out")}) as stack:
        stack.unpause("stack_probe")
        real_airflow = stack.airflow
        created: list[int] = []  # the real exit status of each `backfill create`

        def first_create_fails(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
            proc = real_airflow(*args, **kwargs)
            if args[:2] != ("backfill", "create"):
                return proc
            created.append(proc.returncode)
            if created.count(0) == 1 and proc.returncode == 0:  # the first one that worked
                return subprocess.CompletedProcess(
                    proc.args, 1, proc.stdout, "sqlite3.OperationalError: database is locked"
                )
            return proc

        monkeypatch.setattr(stack, "airflow", first_create_fails)
        runs = stack.backfill("stack_probe", "2026-10-01", "2026-10-02")

        assert [(r.logical_date.date() if r.logical_date else None) for r in runs] == [
            date(2026, 10, 1),
            date(2026, 10, 2),
        ]
        assert {r.state for r in runs} == {"success"}
        # The half-made backfill was let finish and closed, then the create ran again.
        assert created.count(0) == 2 and created[-1] == 0, created
        failed = created.index(0) + 1
        assert "database is locked" in stack.log_path(f"backfill-create-{failed}").read_text()
        # Both backfills are closed: the DAG is free for the next one.
        assert stack.query("SELECT count(*) FROM backfill WHERE completed_at IS NULL")[0][0] == 0
        assert stack.query("SELECT is_paused FROM dag WHERE dag_id = 'stack_probe'")[0][0] == 0
