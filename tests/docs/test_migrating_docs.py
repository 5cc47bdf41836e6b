"""docs/migrating.md stays true: each "after" DAG of the page imports through a real DagBag
with its task idempotent, and the page's history script, quoted from here, records the old
dates so that their reruns are no-ops (against PostgreSQL)."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest

from airflow_idempotency.runner import RunContext, RunOutcome, run_idempotently
from support import ROOT

PAGE = (ROOT / "docs" / "migrating.md").read_text(encoding="utf-8")
JOB_DB = "postgresql://etl@db.example.com/shop"  # the page's placeholder; the test's own below


def adopt_history() -> None:
    """The page's script, as the page shows it (devtools/doc_quotes.py)."""
    # [START adopt_history]
    import datetime as dt

    import psycopg

    from airflow_idempotency import run_idempotently

    JOB_DB = "postgresql://etl@db.example.com/shop"  # the job database
    first, last = dt.date(2026, 9, 1), dt.date(2026, 9, 30)  # the dates the old DAG completed

    day = first
    while day <= last:
        run_idempotently(
            connect=lambda: psycopg.connect(JOB_DB),
            job_name="sales.load_sales",  # the migrated task's job name
            run_key=day.isoformat(),
            work=lambda run: {"adopted": 1},  # nothing to do: the old DAG did it
        )
        day += dt.timedelta(days=1)
    # [END adopt_history]


def test_the_history_script_makes_the_old_dates_noops(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the script, every date of its range is completed, and a rerun of one of them
    (a Clear, a backfill) is a no-op that does not call the work; the next date is new."""
    real_connect = psycopg.connect
    monkeypatch.setattr(
        psycopg, "connect", lambda dsn, **kw: real_connect(pg_dsn if dsn == JOB_DB else dsn, **kw)
    )
    adopt_history()  # its JOB_DB is the test's database (psycopg.connect patched above)
    monkeypatch.undo()
    with psycopg.connect(pg_dsn) as conn:
        counted = conn.execute(
            "SELECT count(*), min(run_key), max(run_key) FROM idempotency.job_runs"
            " WHERE job_name = 'sales.load_sales' AND status = 'completed'"
        ).fetchone()
    assert counted == (30, "2026-09-01", "2026-09-30")
    calls: list[str] = []

    def load_sales(run: RunContext) -> dict[str, int]:
        calls.append(run.run_key)
        return {"days": 1}

    for key, outcome in (("2026-09-15", RunOutcome.NOOP), ("2026-10-01", RunOutcome.COMPLETED)):
        result = run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn),
            job_name="sales.load_sales",
            run_key=key,
            work=load_sales,
        )
        assert result.outcome is outcome
    assert calls == ["2026-10-01"]


@pytest.mark.both_airflow_lines
def test_every_after_of_the_page_imports_with_idempotent_tasks(
    airflow_home: Path, tmp_path: Path
) -> None:
    """Each "after" block of the page is a DAG file the line's DagBag imports without error,
    its data tasks idempotent (on 2.11 with the page's import changes of README.md)."""
    from airflow_idempotency import IdempotentRunOperator
    from devtools.airflow_env import AIRFLOW_2
    from support.dag_runs import load_dag_bag

    blocks = re.findall(
        r"<!-- migrating: (after-[\w-]+) -->\n```python\n(.*?)^```$", PAGE, re.M | re.S
    )
    assert [name for name, _ in blocks] == ["after-python-operator", "after-task"]
    for name, code in blocks:
        if AIRFLOW_2:
            code = code.replace(
                "from airflow.sdk import DAG, task\n",
                "from airflow import DAG\nfrom airflow.decorators import task\n",
            ).replace("from airflow.sdk import DAG\n", "from airflow import DAG\n")
        (tmp_path / f"{name.replace('-', '_')}.py").write_text(code, encoding="utf-8")
    bag = load_dag_bag(tmp_path)
    assert not bag.import_errors, bag.import_errors
    assert bag.dags["sales"].get_task("load_sales").__class__ is IdempotentRunOperator
    taskflow = bag.dags["sales_taskflow"].get_task("load_sales")
    assert isinstance(taskflow, IdempotentRunOperator) and taskflow.job_name == "sales.load_sales"
