"""The fixtures the stack's tests share: a job database for a module's stack, and a browser
for the tests that drive Airflow's pages."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from devtools.postgres import PostgresServer, temporary_database
from support.browser import chromium

if TYPE_CHECKING:
    from playwright.sync_api import Browser


@pytest.fixture(scope="module")
def job_dsn(pg_server: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh job database for the module (its tests share one Airflow stack), dropped after."""
    module = request.module.__name__.removeprefix("test_")
    with temporary_database(pg_server, f"idem_{module}") as dsn:
        yield dsn


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium for the module (skipped where it is missing, failed in CI)."""
    with chromium() as launched:
        yield launched


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: ``IDEMPOTENCY_UI_SCREENSHOTS``, else a temporary folder."""
    folder = os.environ.get("IDEMPOTENCY_UI_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path
