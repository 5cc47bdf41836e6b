"""The built distributions: the provider's wheel holds the provider and nothing else."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from support import ROOT


def _build_wheel(project: Path, out_dir: Path) -> Path:
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    subprocess.run(
        [uv, "build", "--wheel", "--out-dir", str(out_dir), str(project)],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = out_dir.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def provider_wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return zipfile.ZipFile(_build_wheel(ROOT, tmp_path_factory.mktemp("provider-wheel")))


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in wheel.namelist() if n.endswith(f".dist-info/{name}")]
    return wheel.read(path).decode()


def test_provider_wheel_holds_only_the_provider_package(provider_wheel: zipfile.ZipFile) -> None:
    """Every file of the wheel is under airflow_idempotency/ or its .dist-info (no example code)."""
    top_levels = {name.split("/", 1)[0] for name in provider_wheel.namelist()}
    packages = {t for t in top_levels if not t.endswith(".dist-info")}
    assert packages == {"airflow_idempotency"}, top_levels
    names = set(provider_wheel.namelist())
    for shipped in (
        "py.typed",
        "sql/queries.sql",
        "sql/migrations/0001_job_runs.sql",
        "ui/templates/base.html",
        "ui/templates/key.html",
    ):
        assert f"airflow_idempotency/{shipped}" in names, shipped


def test_provider_wheel_entry_points(provider_wheel: zipfile.ZipFile) -> None:
    """The wheel declares the provider entry point, the plugin's and one console script, our CLI."""
    entry_points = _dist_info(provider_wheel, "entry_points.txt")
    assert "[apache_airflow_provider]" in entry_points
    assert "provider_info = airflow_idempotency.provider_info:get_provider_info" in entry_points
    assert "[airflow.plugins]" in entry_points
    assert "idempotency = airflow_idempotency.plugin:IdempotencyPlugin" in entry_points
    scripts = entry_points.split("[console_scripts]", 1)[1].split("\n[", 1)[0]
    assert [line.split("=")[0].strip() for line in scripts.strip().splitlines()] == [
        "airflow-idempotency"
    ]


def test_provider_metadata_users_look_for(provider_wheel: zipfile.ZipFile) -> None:
    """Classifiers, project URLs and the declared dependencies are in the wheel's METADATA."""
    metadata = Parser().parsestr(_dist_info(provider_wheel, "METADATA"))
    classifiers = metadata.get_all("Classifier") or []
    assert "Framework :: Apache Airflow" in classifiers
    assert "Framework :: Apache Airflow :: Provider" in classifiers
    urls = {u.split(",", 1)[0].strip() for u in metadata.get_all("Project-URL") or []}
    assert {"Documentation", "Source", "Changelog", "Bug Tracker"} <= urls, urls
    requires = " ".join(metadata.get_all("Requires-Dist") or [])
    for dependency in ("apache-airflow", "psycopg", "rich", "httpx", "tenacity", "pendulum"):
        assert dependency in requires, dependency
    assert "starlette" not in requires and "uvicorn" not in requires

    from airflow_idempotency import __version__

    assert metadata["Version"] == __version__


def test_example_service_is_its_own_distribution(tmp_path: Path) -> None:
    """The accounting service builds as its own wheel, holding accounting_service only."""
    wheel = zipfile.ZipFile(_build_wheel(ROOT / "accounting", tmp_path))
    packages = {n.split("/", 1)[0] for n in wheel.namelist() if ".dist-info/" not in n}
    assert packages == {"accounting_service"}
    assert "accounting-service = accounting_service.__main__:main" in _dist_info(
        wheel, "entry_points.txt"
    )


def test_wheel_and_sdist_pass_twine_check(tmp_path: Path) -> None:
    """The sdist and the wheel build (as `python -m build` makes them) and pass
    `twine check --strict`: their metadata and the README as PyPI would render it; the
    sdist builds the same wheel again (what pip does with an sdist)."""
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    subprocess.run(
        [uv, "build", "--sdist", "--wheel", "--out-dir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    (sdist,) = tmp_path.glob("*.tar.gz")
    (wheel,) = tmp_path.glob("*.whl")
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2, checked.stdout
    again = _build_wheel(sdist, tmp_path / "from-sdist")
    assert sorted(zipfile.ZipFile(again).namelist()) == sorted(zipfile.ZipFile(wheel).namelist())


def test_read_the_docs_builds_the_site_as_ci_does() -> None:
    """.readthedocs.yaml builds docs/conf.py with warnings as errors, installing the provider
    with an extra that exists, at the versions of a lock file that exists."""
    import tomllib
    import yaml

    config = yaml.safe_load((ROOT / ".readthedocs.yaml").read_text())
    assert config["version"] == 2
    assert config["sphinx"] == {"configuration": "docs/conf.py", "fail_on_warning": True}
    (install,) = config["build"]["jobs"]["install"]
    assert install == 'pip install -c requirements/lock.txt ".[docs]"'
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert {"sphinx", "myst-parser", "furo", "sphinx-argparse", "sphinxcontrib-mermaid"} <= {
        req.split(">")[0] for req in extras["docs"]
    }
