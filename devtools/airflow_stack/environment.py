"""The environment of a stack: Airflow settings, the metadata URL, Celery, a migrated template.

The stack's environment is :func:`devtools.airflow_env.configure` (an isolated
``AIRFLOW_HOME``), then :func:`stack_env_defaults` (its own api-server, fast DAG parsing and
heartbeats), then :func:`celery_env` for the CeleryExecutor, then the caller's extras.
"""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import socket
import sqlite3
import tempfile
from contextlib import closing
from pathlib import Path
from urllib.parse import quote

from psycopg.conninfo import conninfo_to_dict

from devtools import airflow_env

REDIS_URL = os.environ.get("IDEMPOTENCY_REDIS_URL", "redis://127.0.0.1:6379/0")


def sqlalchemy_url(dsn: str, driver: str = "postgresql+psycopg2") -> str:
    """The SQLAlchemy URL of a libpq DSN (Airflow's metadata connection, Celery's backend)."""
    params = conninfo_to_dict(dsn)
    user = quote(str(params.get("user", "postgres")), safe="")
    password = params.get("password")
    auth = f"{user}:{quote(str(password), safe='')}" if password else user
    host = str(params.get("host", "127.0.0.1"))
    port = str(params.get("port", "5432"))
    dbname = quote(str(params.get("dbname", "postgres")))
    if host.startswith("/"):  # a Unix socket folder (the embedded server): a query parameter
        return f"{driver}://{auth}@/{dbname}?host={quote(host, safe='/')}&port={port}"
    return f"{driver}://{auth}@{host}:{port}/{dbname}"


def celery_env(metadata_dsn: str, broker_url: str = REDIS_URL) -> dict[str, str]:
    """The CeleryExecutor settings of a stack: Redis broker, results in the metadata DB, a
    queue of its own (several stacks may share one Redis), and short timeouts for a worker
    that died (the scheduler fails its running tasks into their retries after 30 s, and
    requeues what it had queued after 60 s, instead of 5 and 10 minutes)."""
    return {
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CELERY__BROKER_URL": broker_url,
        "AIRFLOW__CELERY__RESULT_BACKEND": sqlalchemy_url(metadata_dsn, "db+postgresql"),
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
        "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "3600",
        "AIRFLOW__OPERATORS__DEFAULT_QUEUE": f"idem-{secrets.token_hex(4)}",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "60",
    }


def stack_env_defaults(home: Path, dags_folder: Path, port: int) -> dict[str, str]:
    """The settings the stack adds on top of :func:`devtools.airflow_env.configure`."""
    return {
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        # Task runners (LocalExecutor workers) report to the execution API of OUR api-server.
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__WORKERS": "1",
        # Unpausing must not create a scheduled__<today> run next to the backfill runs.
        "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
        "AIRFLOW__SCHEDULER__CATCHUP_BY_DEFAULT": "False",
        # Fast pick-up: the dags-folder bundle is re-listed every 300 s by default and
        # each file re-parsed every 30 s.
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "2",
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "5",
        "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
        "AIRFLOW__DAG_PROCESSOR__PRINT_STATS_INTERVAL": "0",
        "AIRFLOW__DAG_PROCESSOR__STALE_DAG_THRESHOLD": "10",
        # Default is $TMPDIR/airflow, shared by every Airflow on the machine.
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH": str(home / "bundles"),
        # Faster than the defaults (5 s / 1 s), but every heartbeat is a SQLite write and
        # more writers mean more "database is locked" (see AirflowStack.airflow_retrying).
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.5",
        "AIRFLOW__SCHEDULER__PARSING_CLEANUP_INTERVAL": "5",
        # No login for the UI / REST API of a throw-away local stack.
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__CORE__PARALLELISM": "4",
        # Log servers bind fixed ports (8793/8794); the stack starts them with
        # --skip-serve-logs, this is a second line of defence against collisions.
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
    }


def migrated_db_template() -> Path:
    """A freshly migrated, empty metadata DB, made once per Airflow version (~6 s saved).

    ``airflow db migrate`` only writes the schema, ``alembic_version``, ``log_template`` and
    the default pool: nothing that depends on AIRFLOW_HOME, so a copy serves every home.
    """
    version = importlib.metadata.version("apache-airflow")
    template = Path(tempfile.gettempdir()) / f"idem-airflow-{version}-migrated.db"
    if template.exists():
        return template
    scratch = Path(tempfile.mkdtemp(prefix="idem-airflow-template-"))
    env = dict(os.environ)
    airflow_env.configure(scratch, env)
    airflow_env.migrate(env)
    tmp = template.with_name(f"{template.name}.{os.getpid()}.tmp")
    # The backup API folds the WAL into one self-contained file.
    with (
        closing(sqlite3.connect(scratch / "airflow.db")) as src,
        closing(sqlite3.connect(tmp)) as dst,
    ):
        src.backup(dst)
    os.replace(tmp, template)
    return template


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
