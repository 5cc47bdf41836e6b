"""README.md stays true: its quoted code is the code the tests run, its commands are CI's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def region(text: str, name: str) -> str:
    match = re.search(rf"# \[START {name}\]\n(.*?)\n# \[END {name}\]", text, re.S)
    assert match, f"region {name} not found"
    return match.group(1).strip("\n")


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("finalize_invoices", "dags/finalize_invoices.py"),
        ("create_invoices", "dags/invoicing/tasks.py"),
        ("export_invoices", "dags/invoicing/tasks.py"),
    ],
)
def test_quoted_code_matches_the_dag_files(name: str, source: str) -> None:
    """Each code region quoted in README.md is identical to the file the tests execute."""
    assert region(README, name) == region((ROOT / source).read_text(encoding="utf-8"), name)


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run calls the test command written at the top of README.md."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 dev.py test     # the whole test suite" in README
    assert re.search(r"^python3 dev\.py test$", ci, re.M)
    assert "`python3 dev.py test --airflow 2`" in README
    assert re.search(r"^python3 dev\.py test --airflow 2$", ci, re.M)
