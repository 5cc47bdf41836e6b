"""The CLI as the tests call it, and the records it reads, written by the real runner.

In process (``cli``), in an Airflow home of its own (``airflow_cli``), and the records it
reads, written by the real runner (``record``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_idempotency import RunContext, run_idempotently
from airflow_idempotency.cli import main
from support.workers import private_airflow_env


def record(dsn: str, job: str, key: str, fail: bool = False) -> None:
    """One run of (job, key) through the runner: completed, or failed when ``fail``."""

    def work(run: RunContext) -> None:
        if fail:
            raise RuntimeError(f"{key} broke")

    with contextlib.suppress(RuntimeError):
        run_idempotently(connect=lambda: psycopg.connect(dsn), job_name=job, run_key=key, work=work)


def abandon(dsn: str, job: str, key: str, lock_mode: str = "advisory") -> None:
    """A worker killed after its run started: the key says started, its attempt running. In
    the lease mode its lease stays live until it expires (the default time to live, 30 s)."""
    code = (
        "import psycopg; from airflow_idempotency import run_idempotently;"
        f"run_idempotently(connect=lambda: psycopg.connect({dsn!r}), job_name={job!r},"
        f" run_key={key!r}, work=lambda ctx: None, lock_mode={lock_mode!r})"
    )
    env = {**os.environ, "AIRFLOW_IDEMPOTENCY_CRASH_AT": "runner.after_started"}
    assert (
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == -9
    )


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    """``airflow-idempotency ARGV --json`` in process: its exit code, its JSON, its stderr."""
    capsys.readouterr()  # what the test logged before (Airflow 2 logs to stdout)
    code = main([*argv, "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out) if out.out.strip() else None, out.err


def airflow_cli(
    airflow_home: Path, dsn: str, dags: Path, *argv: str
) -> subprocess.CompletedProcess[str]:
    """``python -m airflow_idempotency.cli ARGV`` in a private Airflow home with ``dags``."""
    return cli_process_with(private_airflow_env(airflow_home, dsn, dags), *argv)


def cli_process_with(env: Mapping[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m airflow_idempotency.cli ARGV`` with the environment ``env``, within 300 s."""
    return subprocess.run(
        [sys.executable, "-m", "airflow_idempotency.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
