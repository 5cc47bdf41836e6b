"""The first DAG of README.md runs as written: its blocks, extracted from README.md, in a new
virtual environment made by its own install line, against a real PostgreSQL.

What the test changes, and only that: HOME is a temporary folder (the blocks write to
``~/first-dag``), the connection URI names the test's own database, and on Airflow 2.11 the
two changes README.md's 2.11 paragraph names. docs/quickstart.md shows the same blocks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from devtools.airflow_env import AIRFLOW_2
from support import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")
QUICKSTART = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
README_URI = "postgresql://postgres:postgres@localhost:5432/postgres"
# README.md's paragraph "On Airflow 2.11": the two changes it names, as it writes them.
AIRFLOW2_LOCK = "-c requirements/lock-airflow2.txt"
AIRFLOW2_IMPORTS = "`from airflow import DAG` followed by `from airflow.decorators import task`"


def block(text: str, name: str) -> str:
    """The fenced block after the ``<!-- NAME -->`` marker of ``text``."""
    found = re.search(rf"<!-- {re.escape(name)} -->\n```\w+\n(.*?)^```$", text, re.M | re.S)
    assert found, f"no block marked <!-- {name} -->"
    return found.group(1)


def test_the_quick_start_shows_the_readmes_first_dag() -> None:
    """docs/quickstart.md holds README.md's first-DAG blocks, identical."""
    for name in ("first-dag: install", "first-dag: dag", "first-dag: run", "install: existing"):
        assert block(QUICKSTART, name) == block(README, name), name


def _uri(dsn: str) -> str:
    """``dsn`` as an Airflow connection URI (a socket directory percent-encoded as host),
    with a password as README.md's has one: a trusting server ignores it, and Airflow
    2.11's `connections add --conn-uri` fails on a URI without one (docs/faq.md)."""
    p = conninfo_to_dict(dsn)
    login = quote(str(p.get("user", "postgres")), safe="")
    password = f":{quote(str(p.get('password') or 'postgres'), safe='')}"
    host = quote(str(p.get("host", "127.0.0.1")), safe="")
    port = f":{p['port']}" if p.get("port") else ""
    return f"postgresql://{login}{password}@{host}{port}/{p['dbname']}"


def _environment(home: Path) -> dict[str, str]:
    """The user's shell: no Airflow settings of this test session, no active venv; pip's
    configuration and cache where they were (HOME moves)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VIRTUAL_ENV"))}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    real_home = Path.home()
    env.setdefault("XDG_CONFIG_HOME", str(real_home / ".config"))
    env.setdefault("XDG_CACHE_HOME", str(real_home / ".cache"))
    env["HOME"] = str(home)
    return env


def _checkout(to: Path) -> Path:
    """The files a clone has that `pip install .` reads."""
    to.mkdir()
    for name in ("pyproject.toml", "README.md", "CHANGELOG.md"):
        shutil.copy2(ROOT / name, to / name)
    shutil.copytree(ROOT / "requirements", to / "requirements")
    shutil.copytree(
        ROOT / "provider",
        to / "provider",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    return to


@pytest.mark.slow  # a new venv and a pip install (~30 s), two `airflow dags test` (~15 s)
@pytest.mark.airflow_processes
@pytest.mark.both_airflow_lines
def test_the_readmes_first_dag_runs_twice_the_second_a_noop(pg_dsn: str, tmp_path: Path) -> None:
    """README.md's install, DAG and run blocks, run as a user pastes them: both runs
    succeed, the function runs once, the second run logs README.md's no-op line."""
    install, dag, run = (block(README, f"first-dag: {b}") for b in ("install", "dag", "run"))
    assert README_URI in run
    run = run.replace(README_URI, _uri(pg_dsn))
    if AIRFLOW_2:
        assert AIRFLOW2_LOCK in README and AIRFLOW2_IMPORTS in README
        install = install.replace("-c requirements/lock.txt", AIRFLOW2_LOCK)
        assert "from airflow.sdk import DAG, task\n" in dag
        dag = dag.replace(
            "from airflow.sdk import DAG, task\n",
            "from airflow import DAG\nfrom airflow.decorators import task\n",
        )
    saved_as = re.search(r"Save this as `(~/[^`]+\.py)`", README)
    assert saved_as, "README.md no longer says where to save the DAG"
    home = tmp_path / "home"
    home.mkdir()
    dag_file = saved_as.group(1).replace("~", str(home), 1)
    script = f"{install}\ncat > {dag_file} <<'PYTHON'\n{dag}PYTHON\n{run}"
    done = subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=_checkout(tmp_path / "clone"),
        env=_environment(home),
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]

    # Airflow 2.11 also prints the task's log lines through its root logger: each may be
    # there twice. What ran is counted in the database below.
    assert "completed: {'days': 1}" in output, output[-6000:]
    noop = block(README, "first-dag: no-op").strip()
    # The line as README.md shows it, its completion time (that run's own) left open.
    pattern = re.escape(noop).replace(
        re.escape("completed 2026-12-06 06:37:42.458581+00:00"), r"completed [0-9: .+-]+"
    )
    assert pattern != re.escape(noop), "README's no-op line changed shape: update this test"
    assert re.search(pattern, output), output[-6000:]
    with psycopg.connect(pg_dsn) as conn:
        days = conn.execute("SELECT day::text FROM daily_summary").fetchall()
        attempts = conn.execute(
            "SELECT outcome FROM idempotency.job_run_attempts ORDER BY attempt_id"
        ).fetchall()
    assert days == [("2026-10-01",)]
    assert attempts == [("completed",), ("noop",)]


@pytest.mark.both_airflow_lines
def test_installing_into_an_existing_airflow_moves_nothing(tmp_path: Path) -> None:
    """README.md's command for an Airflow you already run installs the provider alone (pip's
    own dry-run report, in this line's environment); the lock file's would move Airflow."""
    existing = block(README, "install: existing")
    freeze, install = existing.strip().splitlines()
    pip = [sys.executable, "-m", "pip"]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run(
        ["bash", "-e", "-c", freeze.replace("pip ", f"{sys.executable} -m pip ", 1)],
        cwd=tmp_path,
        env=env,
        check=True,
    )
    assert install == "pip install -c installed.txt ."
    report = tmp_path / "report.json"
    subprocess.run(
        [
            *pip,
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            str(report),
            "-c",
            str(tmp_path / "installed.txt"),
            str(ROOT),
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    import json

    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["airflow-provider-idempotency"], installs
