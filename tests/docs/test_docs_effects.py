"""docs/side-effects.md stays true: the code it quotes exists between its markers in tested
files, and every test its guarantee table names exists."""

from __future__ import annotations

import ast
import re

from support import ROOT

DOC = ROOT / "docs" / "side-effects.md"


def test_the_page_quotes_tested_code() -> None:
    """The page's code blocks are quoted from tested files (devtools/doc_quotes.py checks
    that each is its source's region: tests/docs/test_docs.py)."""
    from devtools import doc_quotes

    assert len(doc_quotes.quotes(DOC)) >= 3


def test_the_guarantee_table_names_tests_that_exist() -> None:
    """Every test the guarantee table cites is a test function (or module) of the suite."""
    text = DOC.read_text(encoding="utf-8")
    table = text.split("This table is the tested behaviour", 1)[1].split("\n\n", 2)[1]
    cited = re.findall(r"`(tests/[\w/]*test_\w+\.py)(?:::(\w+))?`", table)
    assert len(table.splitlines()) >= 9 and len(cited) >= 10
    for relative, function in cited:
        path = ROOT / relative
        assert path.exists(), relative
        if function:
            names = {
                n.name
                for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.FunctionDef)
            }
            assert function in names, f"{relative}::{function}"
