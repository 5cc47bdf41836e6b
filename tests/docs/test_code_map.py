"""The code map of docs/development.md names every module with its docstring's summary line.

It is generated (``python3 dev.py codemap``, :mod:`devtools.codemap`); these tests fail when
a module is missing from the page, when a row no longer says what the module's docstring
says, or when a module has no summary line of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools import codemap
from support import ROOT


def test_every_mapped_module_has_a_summary_line_of_its_own() -> None:
    problems = codemap.problems()
    assert not problems, "\n".join(problems)


def test_the_code_map_of_the_development_page_is_up_to_date() -> None:
    page = codemap.PAGE.read_text(encoding="utf-8")
    wanted = codemap.rewrite(page, codemap.render())
    assert wanted == page, (
        "docs/development.md's code map is stale: run `python3 dev.py codemap` and commit the page"
    )


def test_the_code_map_names_every_module_of_the_mapped_folders() -> None:
    """Independently of the generator's own walk: every ``.py`` file of the mapped folders has
    its row (a module the walk skipped would be missing from a page the first test passes)."""
    page = codemap.PAGE.read_text(encoding="utf-8")
    rows = page[page.index(codemap.START) : page.index(codemap.END)]
    missing = []
    for folder in codemap.FOLDERS:
        base = ROOT / folder
        paths = [base] if base.is_file() else sorted(base.rglob("*.py"))
        assert paths, f"{folder} has no module"
        for path in paths:
            name = path.name if path == base else path.relative_to(base).as_posix()
            if f"| `{name}` |" not in rows:
                missing.append(path.relative_to(ROOT).as_posix())
    modules = rows.count("\n| `")
    assert not missing and modules > 150, (missing, modules)
    assert "provider/airflow_idempotency" in codemap.FOLDERS and "devtools" in codemap.FOLDERS


def _folder(tmp_path: Path, modules: dict[str, str]) -> dict[str, str]:
    for name, source in modules.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    return {"pkg": "a package"}


def test_a_new_module_makes_the_map_stale(tmp_path: Path) -> None:
    folders = _folder(tmp_path, {"__init__.py": '"""The package."""\n'})
    before = codemap.render(tmp_path, folders)
    _folder(tmp_path, {"sub/new.py": '"""A new module: ``code`` and :class:`~a.b.C` | here.\n"""'})
    after = codemap.render(tmp_path, folders)
    assert after != before
    assert "| `sub/new.py` | A new module: `code` and `C` \\| here. |" in after.splitlines()
    page = f"# Page\n\n{before}\n\nafter\n"
    assert codemap.rewrite(page, after) == f"# Page\n\n{after}\n\nafter\n"
    with pytest.raises(codemap.CodeMapError, match="no code map markers"):
        codemap.rewrite("# Page without the markers\n", after)


@pytest.mark.parametrize(
    ("source", "row", "problem"),
    [
        ("x = 1\n", "", "pkg/bad.py has no module docstring"),
        ('"""A first line that\nruns on.\n\nMore."""\n', "A first line that runs on.", "runs on"),
        (f'"""{"x" * (codemap.MAX_SUMMARY + 1)}"""\n', "x" * 101, "shorten it to at most 100"),
    ],
)
def test_a_module_without_a_summary_line_keeps_its_row_and_is_named(
    tmp_path: Path, source: str, row: str, problem: str
) -> None:
    folders = _folder(tmp_path, {"bad.py": source})
    assert f"| `bad.py` | {row} |" in codemap.render(tmp_path, folders).splitlines()
    found = codemap.problems(tmp_path, folders)
    assert len(found) == 1 and problem in found[0], found
