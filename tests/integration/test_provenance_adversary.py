"""Adversary of provenance and the commands that print it (issue 34): hostile text in what a
task execution records, printed by ``show`` and ``runs``.

Found:
- the tables of every command were printed through rich with its markup on: a task's error
  text holding ``[/data/in.csv]`` made ``show`` crash (MarkupError), ``missing [amount,
  region]`` printed as ``missing``, and ``[link=...]`` wrote a terminal hyperlink
  (``test_show_prints_hostile_text_as_it_was_recorded``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
from airflow.providers.common.compat.sdk import task

from airflow_idempotency import RunContext
from airflow_idempotency.cli import main
from airflow_idempotency.cli._output import emit
from support.dag_runs import FAILED, daily_dag, run_dag, utc

pytestmark = [pytest.mark.usefixtures("airflow_home"), pytest.mark.both_airflow_lines]

HOSTILE = "cannot read [/data/in.csv]; missing [amount, region] [link=https://x.example]é[/link]"


def hostile_dag(dag_id: str) -> Any:
    with daily_dag(dag_id) as dag:

        @task.idempotent_run(retries=0)
        def load(run: RunContext) -> None:
            raise RuntimeError(HOSTILE)

        load()  # type: ignore[call-arg, misc]  # the operator passes the RunContext
    return dag


def test_show_prints_hostile_text_as_it_was_recorded(
    airflow_pg_conn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A task's error text is the user's (or a library's): printed as written, markup and all;
    the job name and run key in the title too."""
    dag_run = run_dag(hostile_dag("prov_hostile"), logical_date=utc(2026, 10, 2, 1))
    assert dag_run.state == FAILED
    capsys.readouterr()
    argv = ["show", "prov_hostile.load", "2026-10-01", "--dsn", airflow_pg_conn]
    assert main([*argv, "--json"]) == 0
    (attempt,) = json.loads(capsys.readouterr().out)["attempts"]
    assert HOSTILE in attempt["error"]
    assert main(argv) == 0  # the table: no MarkupError
    assert "[/data/in.csv]" in capsys.readouterr().out
    # Each cell as written (one column, wide enough not to fold): no markup read in it.
    args = argparse.Namespace(json=False)
    emit(args, "[bold]title[/bold]", [{"error": HOSTILE}], ["error"])
    table = capsys.readouterr().out
    assert HOSTILE in table and "[bold]title[/bold]" in table, table
    assert "\x1b]8;" not in table  # no terminal hyperlink
