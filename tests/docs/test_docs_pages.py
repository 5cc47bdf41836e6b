"""The newcomer's pages stay true: the FAQ has a row for every exception a user can meet,
and the pages are in the site's table of contents and the README's list."""

from __future__ import annotations

import inspect
import re

from support import ROOT

DOCS = ROOT / "docs"
NEW_PAGES = ("connection", "faq", "how-it-works", "migrating")


def test_the_faq_names_every_exception_of_the_provider() -> None:
    """Every IdempotencyError subclass of airflow_idempotency.exceptions is named in
    docs/faq.md, so a new refusal gets its row."""
    from airflow_idempotency import exceptions

    names = {
        name
        for name, value in vars(exceptions).items()
        if inspect.isclass(value)
        and issubclass(value, exceptions.IdempotencyError)
        and value.__module__ == exceptions.__name__
    }
    generic = {"IdempotencyError", "InvalidInputError", "ConfigurationError", "RemoteError"}
    faq = (DOCS / "faq.md").read_text(encoding="utf-8")
    missing = sorted(n for n in names - generic if f"`{n}`" not in faq)
    assert len(names) >= 20 and not missing, missing


def test_the_new_pages_are_in_the_toctree() -> None:
    """Each page of this guide is in a toctree of docs/index.md (else Sphinx builds it
    orphaned, and -W fails the build)."""
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    toctrees = "".join(re.findall(r"```\{toctree\}(.*?)```", index, re.S))
    assert all(re.search(rf"^{page}$", toctrees, re.M) for page in NEW_PAGES)


def test_the_diagram_is_mermaid_that_github_and_sphinx_render() -> None:
    """docs/how-it-works.md draws the contract in one ```mermaid block (GitHub renders it;
    the site through sphinxcontrib-mermaid, declared in docs/conf.py)."""
    page = (DOCS / "how-it-works.md").read_text(encoding="utf-8")
    assert page.count("```mermaid\nsequenceDiagram\n") == 1
    conf = (DOCS / "conf.py").read_text(encoding="utf-8")
    assert '"sphinxcontrib.mermaid"' in conf and 'myst_fence_as_directive = ["mermaid"]' in conf


def _github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page (and MyST, whose
    myst_heading_anchors slugs the same way): the heading's text, lower-cased, every
    character but letters, digits, ``_``, ``-`` and spaces dropped, spaces as ``-``; a
    repeated anchor gets ``-1``, ``-2``, ..."""
    anchors: set[str] = set()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6} +(.*?) *#*$", prose, re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_every_link_between_pages_lands_on_its_heading_on_github() -> None:
    """Each relative link of README.md and docs/*.md names a file that exists and, with a
    ``#fragment``, a heading of that page as GitHub slugs it (Sphinx also makes a
    collapsed id, so a link may work on the site and land at the page's top on GitHub)."""
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        prose = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif (
                fragment
                and linked.suffix == ".md"
                and fragment not in _github_anchors(linked.read_text(encoding="utf-8"))
            ):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_the_dbt_page_shows_the_tested_project_as_it_is() -> None:
    """Each SQL block of docs/dbt.md is a part of tests/dbt_project's models or macros,
    verbatim (the project tests/stack/test_dbt_cosmos.py runs), so the page never shows a
    stale model."""
    page = (DOCS / "dbt.md").read_text(encoding="utf-8")
    project = DOCS.parent / "tests" / "dbt_project"
    sources = [p.read_text(encoding="utf-8") for p in sorted(project.rglob("*.sql"))]
    blocks = re.findall(r"^```sql\+jinja\n(.*?)^```$", page, re.M | re.S)
    assert len(blocks) >= 3, blocks
    stale = [b for b in blocks if not any(b in source for source in sources)]
    assert not stale, f"docs/dbt.md blocks not in tests/dbt_project: {stale}"
