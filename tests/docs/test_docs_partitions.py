"""docs/partitioned-runs.md stays true: its quoted code is the code the tests run."""

from __future__ import annotations

import re
import textwrap

import pytest

from support import ROOT

PAGE = (ROOT / "docs" / "partitioned-runs.md").read_text(encoding="utf-8")


def region(text: str, name: str) -> str:
    """The lines between ``# [START name]`` and ``# [END name]``, dedented."""
    match = re.search(
        rf"^([ \t]*)# \[START {name}\]\n(.*?)\n[ \t]*# \[END {name}\]", text, re.M | re.S
    )
    assert match, f"region {name} not found"
    return textwrap.dedent(match.group(2)).strip("\n")


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("invoice_regions", "dags/partitioned_invoices.py"),
        ("regional_reconciliation", "dags/partitioned_invoices.py"),
        ("region_tasks", "dags/invoicing/tasks.py"),
        ("migration_cron", "tests/stack/test_partitions_stack.py"),
        ("migration_partitioned", "tests/stack/test_partitions_stack.py"),
    ],
)
def test_quoted_code_matches_the_tested_files(name: str, source: str) -> None:
    """Each code region quoted in docs/partitioned-runs.md is the file the tests execute."""
    assert region(PAGE, name) == region((ROOT / source).read_text(encoding="utf-8"), name)


def test_the_readme_links_the_page() -> None:
    """The README's Documentation section points at this page, by its name."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "[Partitioned runs (Airflow 3.2+)](docs/partitioned-runs.md)" in readme
