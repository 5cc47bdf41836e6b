"""docs/side-effects.md stays true: the code it quotes exists between its markers in tested
files, and every test its guarantee table names exists."""

from __future__ import annotations

import ast
import re

from support import ROOT

DOC = ROOT / "docs" / "side-effects.md"


def test_quoted_regions_exist_in_their_files() -> None:
    """Each literalinclude names a file and a [START x]/[END x] pair present in it, with code between."""
    text = DOC.read_text(encoding="utf-8")
    includes = re.findall(
        r"```\{literalinclude\} (\S+)\n(?::\w+: .*\n)*?:start-after: \"(.+)\"\n:end-before: \"(.+)\"",
        text,
    )
    assert len(includes) == text.count("{literalinclude}") >= 3
    for relative, start, end in includes:
        source = (DOC.parent / relative).resolve().read_text(encoding="utf-8")
        assert source.count(start) == 1 and source.count(end) == 1, (relative, start)
        body = source.split(start, 1)[1].split(end, 1)[0]
        assert body.strip(), (relative, start)


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
