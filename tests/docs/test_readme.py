"""README.md stays true: its quoted code is the code the tests run, its commands are CI's."""

from __future__ import annotations

import re

from support import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_quoted_code_matches_the_dag_files() -> None:
    """The example code README.md quotes is the file the tests execute (its quote marker names
    the region; tests/docs/test_docs.py checks every quote of the README and the docs)."""
    from devtools import doc_quotes

    (quote,) = doc_quotes.quotes(ROOT / "README.md")
    assert (quote.source, quote.name) == (
        ROOT / "dags" / "finalize_invoices.py",
        "finalize_invoices",
    )
    assert quote.shown == doc_quotes.expected(quote)


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run calls the test command written at the top of README.md."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 dev.py test     # the whole test suite" in README
    assert re.search(r"^python3 dev\.py test$", ci, re.M)
    assert "`python3 dev.py test --airflow 2`" in README
    assert re.search(r"^python3 dev\.py test --airflow 2$", ci, re.M)


def test_readme_links_point_at_files_of_the_checkout() -> None:
    """Every relative link of README.md (into docs/, its images, CHANGELOG.md) names a file
    that exists, so the README's way into the docs never dangles."""
    targets = re.findall(r"\]\((?!https?://|#|mailto:)([^)#\s]+)", README)
    assert targets, "README.md links nowhere"
    missing = [t for t in targets if not (ROOT / t).is_file()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_links_every_docs_page() -> None:
    """The README's Documentation section is the way into the whole site: every page of
    docs/ is linked from it."""
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    unlinked = [page for page in pages if f"]({page})" not in README and f"]({page}#" not in README]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_readme_builds_the_docs_as_the_docs_test_does() -> None:
    """The docs command written in README.md is the build tests/docs/test_docs.py runs."""
    from test_docs import SPHINX_BUILD

    command = f".venv/bin/python {' '.join(SPHINX_BUILD)} docs docs/_build/html"
    assert f"python3 dev.py setup && {command}" in README


def test_the_pythons_the_pages_name_are_those_the_lock_files_install_on() -> None:
    """README.md and the quick start tell a new user which Pythons the first DAG and
    dev.py take; both install from the lock files, which are compiled for one Python
    (`--python-version`) and pin packages that need it (apache-airflow-providers-smtp 3.2.0
    requires 3.11): the oldest Python named must not be older, or the install line fails
    with ResolutionImpossible."""
    oldest = set()
    for lock in sorted((ROOT / "requirements").glob("lock*.txt")):
        found = re.search(r"--python-version (3\.\d+)", lock.read_text(encoding="utf-8"))
        assert found, lock
        oldest.add(tuple(int(n) for n in found[1].split(".")))
    (floor,) = oldest
    dash = "[-\u2013]"  # a hyphen or an en dash
    for page in (ROOT / "README.md", ROOT / "docs" / "quickstart.md", ROOT / "dev.py"):
        text = page.read_text(encoding="utf-8")
        named = re.findall(rf"Python (3\.\d+)(?: to | or |{dash})3\.\d+", text)
        named += re.findall(rf"\((3\.\d+){dash}3\.\d+ work\)", text)
        assert named, page
        for version in named:
            assert tuple(int(n) for n in version.split(".")) >= floor, (page.name, version)
