"""Test set-up: a real PostgreSQL server and a real, isolated Airflow 3; the tiers' markers.

Airflow reads its configuration once, when first imported, so the environment is set at
the top of this module, before any test module imports ``airflow``.

The tests live in one folder per tier (docs/development.md says which test goes where):
``unit/``, ``integration/``, ``stack/``, ``faults/``, ``docs/``; what they share is the
``support`` package. Every test in ``stack/`` is marked ``airflow_processes`` from its folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools import airflow_env
from devtools.accounting import AccountingService
from devtools.postgres import PostgresServer, find_server, temporary_database
from support.invoice_env import InvoicingEnv
from support.workers import migrated_db

_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="idem-airflow-"))
airflow_env.configure(_AIRFLOW_HOME)


@pytest.fixture(scope="session")
def airflow_home() -> Path:
    """The per-session Airflow home, with a migrated SQLite metadata database; a copy of it as
    migrated is what every worker's private home starts from (support.workers.migrated_db),
    whatever the tests that ran before left in the session's."""
    if not (_AIRFLOW_HOME / ".migrated").exists():
        airflow_env.migrate()
        shutil.copyfile(_AIRFLOW_HOME / "airflow.db", migrated_db(_AIRFLOW_HOME))
        (_AIRFLOW_HOME / ".migrated").touch()
    return _AIRFLOW_HOME


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """The PostgreSQL server for the session: a DSN, the local server or an embedded one."""
    server = find_server()
    yield server
    server.close()


@pytest.fixture
def pg_dsn(pg_server: PostgresServer) -> Iterator[str]:
    """A fresh, empty database for one test, dropped afterwards."""
    with temporary_database(pg_server, "idem_test") as dsn:
        yield dsn


@pytest.fixture
def airflow_pg_conn(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Expose the test database to Airflow as connection ``idempotency_default``."""
    for name, value in airflow_env.connection_env(pg_dsn).items():
        monkeypatch.setenv(name, value)
    return pg_dsn


def pytest_report_header() -> list[str]:
    return [
        f"airflow {airflow_env.AIRFLOW_VERSION} home: {_AIRFLOW_HOME}",
        f"IDEMPOTENCY_PG={os.environ.get('IDEMPOTENCY_PG', 'auto')}",
    ]


LINE_MARKERS = ("both_airflow_lines", "airflow2_only")
TESTS = Path(__file__).resolve().parent
STACK = TESTS / "stack"
"""The tests that start Airflow's own processes: each is marked ``airflow_processes`` here."""
FAULTS = TESTS / "faults"
"""The fault scenarios and chaos: those that start Airflow's processes carry the marker
themselves (test_faults_celery.py, test_chaos.py, test_chaos_builds.py)."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """On 2.11, do not import test modules that mark no test for it: they may import
    Airflow 3 modules at the top (airflow.sdk, airflow.api_fastapi), and none of their
    tests would be kept anyway (see below)."""
    if not airflow_env.AIRFLOW_2 or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    text = collection_path.read_text(encoding="utf-8")
    return None if any(marker in text for marker in LINE_MARKERS) else True


def mark_the_stack_tier(items: list[pytest.Item]) -> None:
    """``airflow_processes`` on every test of ``stack/``; a test elsewhere that carries it
    (but the fault scenarios) belongs in ``stack/``: a usage error says so."""
    for item in items:
        if item.path.is_relative_to(STACK):
            item.add_marker(pytest.mark.airflow_processes)
        elif item.get_closest_marker("airflow_processes") and not item.path.is_relative_to(FAULTS):
            raise pytest.UsageError(
                f"{item.nodeid} starts Airflow's processes (marked airflow_processes) outside "
                f"tests/stack/: move its file there (docs/development.md, the tests' tiers)"
            )


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the stack tier (above), then keep the tests of this Airflow line: on 2.11 the
    suites marked both_airflow_lines and airflow2_only (the Airflow-free suites run once, on
    3.x); on 3.x all but airflow2_only."""
    mark_the_stack_tier(items)
    on_airflow2 = airflow_env.AIRFLOW_VERSION.startswith("2.")

    def kept(item: pytest.Item) -> bool:
        if on_airflow2:
            return any(item.get_closest_marker(m) for m in LINE_MARKERS)
        return item.get_closest_marker("airflow2_only") is None

    selected = [item for item in items if kept(item)]
    if len(selected) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if not kept(item)])
        items[:] = selected


@pytest.fixture
def invoicing(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[InvoicingEnv]:
    """The invoice example's world: seeded orders, a running accounting service process."""
    from devtools.accounting import run_accounting_service

    with run_accounting_service(pg_dsn) as service:
        env = InvoicingEnv(pg_dsn, service)
        for name, value in env.connection_env().items():
            monkeypatch.setenv(name, value)
        yield env


@pytest.fixture
def accounting(pg_dsn: str) -> Iterator[AccountingService]:
    """The accounting service running as its own process on the test database."""
    from devtools.accounting import run_accounting_service

    with run_accounting_service(pg_dsn) as service:
        yield service


@pytest.fixture
def facts(pg_dsn: str) -> str:
    """The test database with a table ``public.facts`` the work writes to (the fence tests:
    support.fenced_work)."""
    from support.fenced_work import create_facts

    return create_facts(pg_dsn)


@pytest.fixture(params=["advisory", "lease"])
def lock_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each lock mode in turn, as the default of every run of the test (run_idempotently's
    lock_mode when not given; docs/locks.md)."""
    from airflow_idempotency import leases

    monkeypatch.setattr(leases, "DEFAULT_LOCK_MODE", request.param)
    return str(request.param)
