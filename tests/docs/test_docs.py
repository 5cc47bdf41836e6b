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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Quote:
    """One literalinclude of a page: the file it quotes and its options."""

    page: str
    path: Path
    options: dict[str, str]


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


def quotes(pages: dict[str, str]) -> list[Quote]:
    """Every literalinclude of ``pages`` (name -> MyST text), with its path resolved."""
    return [
        Quote(page, (DOCS / arg).resolve(), options)
        for page, text in pages.items()
        for arg, options in directives(text, "literalinclude")
    ]


def quote_problems(quote: Quote) -> list[str]:
    """What is wrong with one literalinclude: a missing file, marker or Python object."""
    where = f"{quote.page}: literalinclude {quote.path.relative_to(ROOT)}"
    if not quote.path.is_file():
        return [f"{where}: no such file"]
    text = quote.path.read_text(encoding="utf-8")
    problems = []
    start, end = quote.options.get("start-after"), quote.options.get("end-before")
    if start is None and "pyobject" not in quote.options and "start-at" not in quote.options:
        problems.append(f"{where}: quotes a whole file; name a [START x] region or a pyobject")
    for option in ("start-after", "end-before", "start-at", "end-at"):
        if option in quote.options and quote.options[option] not in text:
            problems.append(f"{where}: {option} {quote.options[option]!r} is not in the file")
    if start is not None:
        region = re.fullmatch(r"\[START (?P<name>[\w.-]+)\]", start)
        if region is None:
            problems.append(f"{where}: start-after {start!r} is not a [START name] marker")
        elif end != f"[END {region['name']}]":
            problems.append(f"{where}: end-before {end!r} does not close [START {region['name']}]")
    if "pyobject" in quote.options:
        name = quote.options["pyobject"].split(".")[-1]
        if not re.search(rf"^\s*(async def|def|class) {re.escape(name)}\b", text, re.M):
            problems.append(f"{where}: no def or class {quote.options['pyobject']!r}")
    return problems


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


def test_every_quoted_region_exists_in_its_file() -> None:
    """Each literalinclude names an existing file and a [START x]/[END x] region (or a
    Python object) that is in it, so the docs quote tested code and never a copy."""
    found = quotes(_pages())
    assert len(found) >= 8, [q.path for q in found]
    problems = [p for quote in found for p in quote_problems(quote)]
    assert not problems, "\n".join(problems)


def test_the_region_check_catches_a_wrong_marker() -> None:
    """A marker missing from its file, or an end that closes another region, is reported."""
    page = (
        "```{literalinclude} ../dags/finalize_invoices.py\n"
        ':start-after: "[START no_such_region]"\n'
        ':end-before: "[END finalize_invoices]"\n'
        "```\n"
    )
    (quote,) = quotes({"bad.md": page})
    problems = quote_problems(quote)
    assert any("'[START no_such_region]' is not in the file" in p for p in problems), problems
    assert any("does not close [START no_such_region]" in p for p in problems), problems
