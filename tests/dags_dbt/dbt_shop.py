"""A dbt project (tests/dbt_project) run by astronomer-cosmos, each model under the contract.

Nothing here imports airflow_idempotency: the DAG's tag ``nightly`` puts each task cosmos
renders (a ``dbt run`` and a ``dbt test`` per model) under the contract when ``[idempotency]
policy_dag_tags`` names it (docs/policy.md, docs/dbt.md). dbt runs from a virtual
environment of its own (``IDEMPOTENCY_DBT_EXECUTABLE``; ``python3 dev.py setup`` makes
.venv-dbt/), as a subprocess of the task.
"""

from __future__ import annotations

import os
from pathlib import Path

import pendulum
from cosmos import DbtDag, ExecutionConfig, ProfileConfig, ProjectConfig, RenderConfig
from cosmos.constants import InvocationMode, LoadMode
from cosmos.profiles import PostgresUserPasswordProfileMapping

DBT_PROJECT = Path(__file__).resolve().parent.parent / "dbt_project"
DBT_EXECUTABLE = os.environ.get("IDEMPOTENCY_DBT_EXECUTABLE", "dbt")

# [START dbt_shop]
dbt_shop = DbtDag(
    dag_id="dbt_shop",
    schedule="0 1 * * *",  # the run fired at D+1 01:00 builds business day D
    start_date=pendulum.datetime(2026, 9, 1, tz="UTC"),
    catchup=False,
    tags=["nightly"],  # [idempotency] policy_dag_tags = nightly: every model under the contract
    project_config=ProjectConfig(DBT_PROJECT, install_dbt_deps=False),
    profile_config=ProfileConfig(
        profile_name="idempotency_shop",
        target_name="airflow",
        profile_mapping=PostgresUserPasswordProfileMapping(
            conn_id="dbt_shop", profile_args={"schema": "analytics"}
        ),
    ),
    # dbt in a virtual environment of its own, run as a subprocess of each task (its pins
    # conflict with Airflow's).
    execution_config=ExecutionConfig(
        dbt_executable_path=DBT_EXECUTABLE, invocation_mode=InvocationMode.SUBPROCESS
    ),
    render_config=RenderConfig(
        load_method=LoadMode.DBT_LS,
        dbt_executable_path=DBT_EXECUTABLE,
        invocation_mode=InvocationMode.SUBPROCESS,
    ),
)
# [END dbt_shop]
