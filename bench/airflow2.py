"""Airflow 2.11 for bench/airflow_e2e.py: ``airflow dags backfill`` in .venv-airflow2.

Airflow 2's backfill runs in the CLI process, without a scheduler, through the configured
executor. Its LocalExecutor refuses SQLite, so this home's metadata database is a
Postgres database of the bench's server (as in production), LocalExecutor with
parallelism 4, the same as the Airflow 3 stack's. The bench itself runs in the Airflow 3
environment: every Airflow 2 step is a subprocess of the 2.11 interpreter
(``IDEMPOTENCY_AIRFLOW2_PYTHON``, exported by dev.py).
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from bench.common import bytecode_env
from devtools import airflow_env

PARALLELISM = 4


def airflow2_python() -> str | None:
    """The 2.11 interpreter, or None when .venv-airflow2 is not set up."""
    python = os.environ.get("IDEMPOTENCY_AIRFLOW2_PYTHON", "")
    return python if python and Path(python).exists() else None


class Airflow2Home:
    """One Airflow 2.11 home: its metadata database migrated, its DAGs folder, a job DB."""

    def __init__(
        self, python: str, home: Path, meta_dsn: str, dags_folder: Path, job_dsn: str
    ) -> None:
        self.python = python
        self.meta_dsn = meta_dsn
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        airflow_env.configure(home, self.env, airflow2=True)
        params = conninfo_to_dict(meta_dsn)
        self.env.update(
            {
                "PATH": f"{Path(python).parent}{os.pathsep}{self.env.get('PATH', '')}",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": (
                    f"postgresql+psycopg2://{params.get('user', 'postgres')}@"
                    f"{params.get('host', '127.0.0.1')}:{params.get('port', 5432)}/"
                    f"{params['dbname']}"
                ),
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                "AIRFLOW__CORE__PARALLELISM": str(PARALLELISM),
                "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
                **airflow_env.connection_env(job_dsn),
                **bytecode_env(home),
            }
        )
        if params.get("password"):
            raise ValueError("the bench's Airflow 2 metadata URL takes no password")
        self.last_backfill = 0.0

    def airflow(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.python, "-m", "airflow", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def migrate(self) -> float:
        t0 = time.monotonic()
        proc = self.airflow("db", "migrate", timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(
                f"airflow db migrate (2.11) exited {proc.returncode}:\n{proc.stderr[-3000:]}"
            )
        return time.monotonic() - t0

    def backfill(self, dag_id: str, first: dt.date, dates: int) -> list[dict[str, Any]]:
        """``airflow dags backfill -s FIRST -e LAST DAG``; the task instances of its runs."""
        last = first + dt.timedelta(days=dates - 1)
        t0 = time.monotonic()
        proc = self.airflow(
            "dags", "backfill", "-s", first.isoformat(), "-e", last.isoformat(), dag_id
        )
        self.last_backfill = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(
                f"airflow dags backfill {dag_id} (2.11) exited {proc.returncode}:\n"
                + (proc.stdout + proc.stderr)[-3000:]
            )
        with psycopg.connect(self.meta_dsn) as conn:
            rows = conn.execute(
                "SELECT ti.run_id, ti.task_id, ti.state, ti.start_date, ti.end_date"
                " FROM task_instance ti JOIN dag_run r"
                " ON r.dag_id = ti.dag_id AND r.run_id = ti.run_id"
                " WHERE ti.dag_id = %s AND r.run_type = 'backfill'"
                " AND r.execution_date >= %s AND r.execution_date < %s",
                (
                    dag_id,
                    dt.datetime.combine(first, dt.time(), dt.timezone.utc),
                    dt.datetime.combine(last + dt.timedelta(days=1), dt.time(), dt.timezone.utc),
                ),
            ).fetchall()
        return [
            {"run_id": r[0], "task_id": r[1], "state": r[2], "start": r[3], "end": r[4]}
            for r in rows
        ]
