"""An isolated Airflow home (SQLite metadata, this checkout's dags/) for tests and the demo.

Everything here is environment variables: call :func:`configure` before anything imports
``airflow``, because Airflow reads its configuration once, at import time.
:func:`connection_env` is the one place where tests, bench, the demo and chaos build the
``AIRFLOW_CONN_*`` variables of the job database and the accounting service.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from psycopg.conninfo import conninfo_to_dict

ROOT = Path(__file__).resolve().parent.parent
DAGS_FOLDER = ROOT / "dags"
AIRFLOW_VERSION = importlib.metadata.version("apache-airflow")
AIRFLOW_2 = AIRFLOW_VERSION.startswith("2.")
# The accounting connection's options where a caller names none: a short timeout and fast
# retries, so that a test of a failing service fails in seconds.
ACCOUNTING_OPTIONS: dict[str, Any] = {"timeout": 2, "backoff_initial": 0.05, "backoff_max": 0.5}


def airflow_connection_json(dsn: str, extra: dict[str, Any] | None = None) -> str:
    """Turn a libpq DSN into the JSON form of an Airflow connection of type postgres, with
    ``extra`` as its extra when given (e.g. ``{"lock_mode": "lease"}``; docs/locks.md)."""
    params = conninfo_to_dict(dsn)
    conn: dict[str, object] = {
        "conn_type": "postgres",
        "host": params.get("host", "127.0.0.1"),
        "login": params.get("user", "postgres"),
        "schema": params.get("dbname", "postgres"),
    }
    if params.get("port"):
        conn["port"] = int(str(params["port"]))
    if params.get("password"):
        conn["password"] = params["password"]
    if extra:
        conn["extra"] = extra
    return json.dumps(conn)


def connection_env(
    job_dsn: str,
    accounting_url: str | None = None,
    *,
    job_extra: dict[str, Any] | None = None,
    **options: Any,
) -> dict[str, str]:
    """``AIRFLOW_CONN_*`` of the job database (``idempotency_default``, its extra
    ``job_extra``: e.g. the lock mode, ``{"lock_mode": "lease", "lease_ttl": 5}``) and, given
    its URL, of the accounting service (``accounting_api``, an http connection whose extra
    holds :data:`ACCOUNTING_OPTIONS` updated with ``options``)."""
    env = {"AIRFLOW_CONN_IDEMPOTENCY_DEFAULT": airflow_connection_json(job_dsn, job_extra)}
    if accounting_url is not None:
        url = urlsplit(accounting_url)
        extra = {**ACCOUNTING_OPTIONS, **options}
        accounting = {"conn_type": "http", "host": url.hostname, "port": url.port, "extra": extra}
        env["AIRFLOW_CONN_ACCOUNTING_API"] = json.dumps(accounting)
    return env


def configure(
    home: Path, environ: dict[str, str] | None = None, *, airflow2: bool = AIRFLOW_2
) -> dict[str, str]:
    """Point Airflow at ``home`` (created if missing) and return the variables set.

    ``airflow2``: the settings for an Airflow 2.11 process (default: this environment's line).
    """
    home.mkdir(parents=True, exist_ok=True)
    env = os.environ if environ is None else environ
    values = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        # Airflow 2's LocalExecutor refuses SQLite; its SequentialExecutor is what `airflow
        # dags backfill` then uses.
        "AIRFLOW__CORE__EXECUTOR": "SequentialExecutor" if airflow2 else "LocalExecutor",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        "AIRFLOW__API_AUTH__JWT_SECRET": "idempotency-local-secret-not-for-production",
        "AIRFLOW__API__SECRET_KEY": "idempotency-local-secret-not-for-production",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    }
    if airflow2:
        # Quiet Airflow 2's start-up warnings about settings that Airflow 3 made the default.
        values["AIRFLOW__METRICS__TIMER_UNIT_CONSISTENCY"] = "True"
        values["AIRFLOW__CORE__FERNET_KEY"] = "m7oL6Ad0LySvaTnMyAz4FkkBRGtfgvi5w7k4UhhlhLA="
    env.update(values)
    return values


def migrate(env: dict[str, str] | None = None, python: str = sys.executable) -> None:
    """Create or upgrade the Airflow metadata database (``airflow db migrate``)."""
    subprocess.run(
        [python, "-m", "airflow", "db", "migrate"],
        check=True,
        env=dict(os.environ if env is None else env),
        stdout=subprocess.DEVNULL,
    )
