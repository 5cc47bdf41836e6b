"""A forced run recomputes a key once (issue 34, found by the adversary of the policy): a retry
of a forced try that completed the key (a worker lost between the completion and Airflow's
success) must not recompute it again; a Clear of the DAG run (a new clear number) or another
forced run does. ``airflow_task.honour_force_once`` decides, on real PostgreSQL, for any way the
completing attempt can differ from the try that asks. The end-to-end case through Airflow is
``test_policy_retry_adversary.test_a_retry_of_a_forced_run_does_not_recompute_again``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_idempotency.airflow_task import TaskRun, honour_force_once
from airflow_idempotency.provenance import Provenance
from airflow_idempotency.records import RunOptions, Trigger
from airflow_idempotency.run_key import ResolvedRunKey
from airflow_idempotency.runner import run_idempotently

JOB = "force-once"
_serial = itertools.count()
SAME = {"run_id": "r1", "task_id": "load", "map_index": None, "clear_number": 0}
OTHER = {"run_id": "r2", "task_id": "other", "map_index": 3, "clear_number": 1}


def _trigger(fields: Mapping[str, Any], try_number: int) -> Trigger:
    return Trigger(
        triggered_by="manual",
        dag_id="d",
        run_id=str(fields["run_id"]),
        task_id=str(fields["task_id"]),
        try_number=try_number,
        map_index=fields["map_index"],
        provenance=Provenance(clear_number=fields["clear_number"]),
    )


def _task_run(run_key: str, trigger: Trigger) -> TaskRun:
    resolved = ResolvedRunKey(run_key, "conf", "from the test")
    options = RunOptions(force=True, dry_run=False)
    logger = logging.getLogger("test")
    return TaskRun(JOB, resolved, options, trigger, "idempotency", logger)


@settings(
    max_examples=20,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    differs=st.sets(st.sampled_from(sorted(SAME))),
    completed=st.booleans(),
    later_try=st.booleans(),
)
def test_force_is_dropped_only_for_a_key_an_earlier_try_of_this_dag_run_completed(
    pg_dsn: str, differs: set[str], completed: bool, later_try: bool
) -> None:
    """``later_try`` False: the asking try is try 1 again, as in a DAG run deleted and
    triggered again for its logical date (the same run id and clear number)."""
    run_key = f"2026-10-{next(_serial):04d}"
    first = {**SAME, **{name: OTHER[name] for name in differs}}

    def work(ctx: object) -> dict[str, int]:
        if not completed:
            raise RuntimeError("the first try fails before completing")
        return {"rows": 1}

    with pytest.raises(RuntimeError) if not completed else contextlib.nullcontext():
        run_idempotently(
            connect=lambda: psycopg.connect(pg_dsn),
            job_name=JOB,
            run_key=run_key,
            work=work,
            options=RunOptions(force=True),
            trigger=_trigger(first, 1),
        )
    database = SimpleNamespace(new_connection=lambda: psycopg.connect(pg_dsn))
    asked = _task_run(run_key, _trigger(SAME, 2 if later_try else 1))
    decided = honour_force_once(database, asked)  # type: ignore[arg-type]
    expected_force = not (completed and not differs and later_try)
    assert decided.options.force is expected_force, (differs, completed, later_try)
    assert decided.options.dry_run is False


def test_no_bookkeeping_tables_yet_keeps_force(pg_dsn: str) -> None:
    database = SimpleNamespace(new_connection=lambda: psycopg.connect(pg_dsn))
    asked = _task_run("2026-10-01", _trigger(SAME, 1))
    assert honour_force_once(database, asked).options.force is True  # type: ignore[arg-type]
