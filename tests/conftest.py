"""Test set-up: a real PostgreSQL server and a real, isolated Airflow 3.

Airflow reads its configuration once, when first imported, so the environment is set at
the top of this module, before any test module imports ``airflow``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from devtools import airflow_env
from devtools.postgres import PostgresServer, find_server

_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="idem-airflow-"))
airflow_env.configure(_AIRFLOW_HOME)


@pytest.fixture(scope="session")
def airflow_home() -> Path:
    """The per-session Airflow home, with a migrated SQLite metadata database."""
    if not (_AIRFLOW_HOME / ".migrated").exists():
        airflow_env.migrate()
        (_AIRFLOW_HOME / ".migrated").touch()
    return _AIRFLOW_HOME


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """The PostgreSQL server for the session: a DSN, the local server or an embedded one."""
    server = find_server()
    yield server
    server.stop()


@pytest.fixture
def pg_dsn(pg_server: PostgresServer) -> Iterator[str]:
    """A fresh, empty database for one test, dropped afterwards."""
    name = pg_server.create_database("idem_test")
    try:
        yield pg_server.dsn(name)
    finally:
        pg_server.drop_database(name)


@pytest.fixture
def airflow_pg_conn(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Expose the test database to Airflow as connection ``idempotency_default``."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_IDEMPOTENCY_DEFAULT", airflow_env.airflow_connection_json(pg_dsn)
    )
    return pg_dsn


def pytest_report_header() -> list[str]:
    return [
        f"airflow home: {_AIRFLOW_HOME}",
        f"IDEMPOTENCY_PG={os.environ.get('IDEMPOTENCY_PG', 'auto')}",
    ]
