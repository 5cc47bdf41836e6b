"""The docs site (docs/) builds with no warning, and its references are complete.

One Sphinx build per module (about 15 s): warnings are errors, as in CI. Runs on the
Airflow 3 line only (no line marker: see conftest.py).
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

DOCS = ROOT / "docs"
# The build CI runs (README.md tells developers the same command): warnings are errors.
SPHINX_BUILD = ("-m", "sphinx", "-W", "--keep-going", "-b", "html")

# A fenced MyST directive: ```{name} argument, then its ":option: value" lines.
_DIRECTIVE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,})\{(?P<name>[\w-]+)\}[ \t]*(?P<arg>[^\n]*)\n"
    r"(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.M | re.S,
)
_OPTION = re.compile(r"^[ \t]*:(?P<key>[\w-]+):[ \t]*(?P<value>[^\n]*)$", re.M)


def _unquote(value: str) -> str:
    value = value.strip()
    return value[1:-1] if len(value) > 1 and value[0] == value[-1] == '"' else value


def directives(text: str, name: str) -> list[tuple[str, dict[str, str]]]:
    """The argument and options of every fenced ``{name}`` directive in MyST ``text``."""
    found = []
    for match in _DIRECTIVE.finditer(text):
        if match["name"] == name:
            options = {m["key"]: _unquote(m["value"]) for m in _OPTION.finditer(match["body"])}
            found.append((match["arg"].strip(), options))
    return found


def _pages() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md"))}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once into a temporary folder as CI builds it (warnings fail it)."""
    out = tmp_path_factory.mktemp("docs-html")
    result = subprocess.run(
        [sys.executable, *SPHINX_BUILD, "-q", str(DOCS), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # -q leaves only Sphinx's warnings and errors on stderr (Python's own warnings too).
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert result.returncode == 0 and not warnings, (
        f"sphinx-build exited {result.returncode} with:\n" + "\n".join(warnings[-60:])
    )
    return out


def test_the_site_builds_without_a_warning(site: Path) -> None:
    """sphinx-build -W succeeds and writes a page for every Markdown source in docs/."""
    for page in _pages():
        assert (site / page.replace(".md", ".html")).is_file(), page


def _cli_parser() -> tuple[argparse.ArgumentParser, str]:
    """The parser cli.md documents (its argparse directive's module and func) and its prog."""
    ((_, options),) = directives((DOCS / "cli.md").read_text(encoding="utf-8"), "argparse")
    module = importlib.import_module(options["module"])
    return getattr(module, options["func"])(), options["prog"]


def test_the_cli_reference_lists_every_command(site: Path) -> None:
    """Every subcommand of the CLI's parser has its section in the CLI reference."""
    parser, prog = _cli_parser()
    assert prog == parser.prog == "airflow-idempotency"
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    commands = sorted(subparsers.choices)
    assert len(commands) >= 11, commands
    html = (site / "cli.html").read_text(encoding="utf-8")
    missing = [c for c in commands if f'<section id="{prog}-{c}">' not in html]
    assert not missing, f"commands missing from the CLI reference: {missing}"


def test_the_api_reference_documents_every_public_name(site: Path) -> None:
    """Every name of airflow_idempotency.__all__ is documented in the API reference."""
    import airflow_idempotency

    html = (site / "api.html").read_text(encoding="utf-8")
    public = [name for name in airflow_idempotency.__all__ if name != "__version__"]
    missing = [name for name in public if f'id="airflow_idempotency.{name}"' not in html]
    assert not missing, f"public names missing from docs/api.md: {missing}"


def test_the_pages_show_code_as_plain_blocks_github_renders() -> None:
    """No page quotes code with a Sphinx-only directive (GitHub shows `{literalinclude}` as
    raw text): code is a plain fenced block, quoted from its tested file
    (devtools/doc_quotes.py)."""
    raw = [page for page, text in _pages().items() if "{literalinclude}" in text]
    assert not raw, f"pages with a literalinclude GitHub cannot render: {raw}"


def test_every_quoted_block_is_its_source() -> None:
    """Each quoted block of README.md and docs/ is identical to the region or object of the
    tested file its marker names, so the docs show tested code and never a stale copy."""
    from devtools import doc_quotes

    found = [q for page in doc_quotes.PAGES for q in doc_quotes.quotes(page)]
    assert len(found) >= 14, [q.label for q in found]
    problems = doc_quotes.problems()
    assert not problems, (
        "\n".join(problems) + "\nrun: .venv/bin/python -m devtools.doc_quotes --write"
    )


def test_the_quote_check_catches_a_drifted_or_missing_quote(tmp_path: Path) -> None:
    """A block that differs from its source, or names a region its file lacks, is reported;
    --write puts the source's text back."""
    from devtools import doc_quotes

    source = tmp_path / "job.py"
    source.write_text("x = 0\n    # [START step]\n    y = 1\n    # [END step]\n")
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- quote: job.py region step -->\n```python\ny = 2\n```\n\n"
        "<!-- quote: job.py region gone -->\n```python\n```\n"
    )
    problems = doc_quotes.problems([page])
    assert any("region step: differs" in p for p in problems), problems
    assert any("no [START gone]" in p for p in problems), problems
    source.write_text(source.read_text() + "# [START gone]\nz = 3\n# [END gone]\n")
    assert doc_quotes.write([page]) == [page]
    assert doc_quotes.problems([page]) == []
    assert "```python\ny = 1\n```" in page.read_text()
