"""Airflow processes in a private Airflow home: ``airflow dags test`` workers.

The workers of the tests and the demo, each in its own process group.

Two ``dags test`` runs of one date against one metadata DB delete each other's runs, so
each worker gets a copy of a migrated SQLite metadata DB: workers share only the job
database, which is exactly where the idempotency contract must hold.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from airflow_idempotency.crashpoints import CRASH_ENV, SLEEP_ENV, WAIT_ENV
from devtools import airflow_env
from devtools.airflow_env import AIRFLOW_2, DAGS_FOLDER


def private_airflow_env(
    metadata_db: Path,
    home: Path,
    connections: Mapping[str, str],
    dags_folder: Path = DAGS_FOLDER,
    *,
    airflow2: bool = AIRFLOW_2,
) -> dict[str, str]:
    """os.environ plus an Airflow home of its own: ``home`` (created; it must not exist, its
    owner removes it) with a copy of the migrated ``metadata_db``, ``dags_folder`` and the
    ``connections`` (``AIRFLOW_CONN_*`` variables).

    Fault points of this process are not inherited: a worker gets them only through the
    variables its caller adds. ``airflow2``: the settings of an Airflow 2.11 worker.
    """
    home.mkdir(parents=True, exist_ok=False)
    shutil.copyfile(metadata_db, home / "airflow.db")
    env = dict(os.environ)
    for name in (CRASH_ENV, SLEEP_ENV, WAIT_ENV):
        env.pop(name, None)
    airflow_env.configure(home, env, airflow2=airflow2)
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(dags_folder)
    if not airflow2:  # where Airflow 3 keeps its DAG bundles: in the home too
        env["AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH"] = str(home / "bundles")
    env.update(connections)
    return env


def start_airflow(
    env: Mapping[str, str],
    *args: str,
    python: str = sys.executable,
    prefix: Sequence[str] = (),
    cwd: Path | None = None,
    output: IO[str] | None = None,
) -> subprocess.Popen[str]:
    """Start ``airflow ARGS`` with ``env`` in its own process group (see :func:`kill_group`).

    Its output (stdout and stderr) goes to ``output``, or to a pipe to read as text.
    ``prefix``: a command that runs it (e.g. ``ip netns exec NAME``).
    """
    return subprocess.Popen(
        [*prefix, python, "-m", "airflow", *args],
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if output is None else output,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def dags_test(
    env: Mapping[str, str],
    dag_id: str,
    logical_date: str | None = None,
    conf: Mapping[str, Any] | str | None = None,
    *,
    python: str = sys.executable,
    prefix: Sequence[str] = (),
    cwd: Path | None = None,
    output: IO[str] | None = None,
) -> subprocess.Popen[str]:
    """Start ``airflow dags test DAG_ID [LOGICAL_DATE] [-c CONF]`` (``conf``: JSON or a
    mapping), as :func:`start_airflow` does."""
    args = ["dags", "test", dag_id]
    if logical_date:
        args.append(logical_date)
    if conf is not None:
        args += ["-c", conf if isinstance(conf, str) else json.dumps(conf)]
    return start_airflow(env, *args, python=python, prefix=prefix, cwd=cwd, output=output)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group of ``proc`` (only ours: its id is the process's pid)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
