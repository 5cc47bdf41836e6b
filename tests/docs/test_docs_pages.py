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
