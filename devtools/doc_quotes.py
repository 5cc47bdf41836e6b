"""Code the docs show is quoted from tested files, as plain Markdown code blocks.

GitHub renders a Markdown page's code blocks but shows a Sphinx ``{literalinclude}`` as raw
text, so the pages quote code as plain fenced blocks, each after a marker that names its
source, and this module keeps every such block identical to its source (the source is the
single truth; tests/docs/test_docs.py fails on any drift and names this command)::

    <!-- quote: ../dags/finalize_invoices.py region finalize_invoices -->
    ```python
    ...the lines between "# [START finalize_invoices]" and "# [END finalize_invoices]"...
    ```

    <!-- quote: ../provider/airflow_idempotency/locks.py object run_lock_key -->
    ```python
    ...the def or class of that name, decorators included...
    ```

The path is relative to the Markdown file; a region's lines are dedented. Run
``.venv/bin/python -m devtools.doc_quotes --write`` after changing a quoted file (without
``--write`` it only reports the blocks that drifted, and exits 1 if any did).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

QUOTE = re.compile(
    r"^<!-- quote: (?P<path>\S+) (?P<kind>region|object) (?P<name>[\w.-]+) -->\n"
    r"(?P<fence>```(?P<language>\w*)\n)(?P<body>.*?)^```$",
    re.M | re.S,
)


@dataclass(frozen=True)
class Quote:
    """One quoted block of a page: where it comes from and what it shows now."""

    page: Path
    source: Path
    kind: str
    name: str
    shown: str
    start: int  # the block's body in the page's text
    end: int

    @property
    def label(self) -> str:
        return f"{_shown(self.page)}: quote of {_shown(self.source)} {self.kind} {self.name}"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def quotes(page: Path, text: str | None = None) -> list[Quote]:
    """Every quoted block of ``page`` (its ``text``, if given)."""
    text = page.read_text(encoding="utf-8") if text is None else text
    return [
        Quote(
            page=page,
            source=(page.parent / match["path"]).resolve(),
            kind=match["kind"],
            name=match["name"],
            shown=match["body"],
            start=match.start("body"),
            end=match.end("body"),
        )
        for match in QUOTE.finditer(text)
    ]


def region(text: str, name: str) -> str:
    """The lines between ``# [START name]`` and ``# [END name]`` of ``text``, dedented."""
    found = re.search(
        rf"^[ \t]*# \[START {re.escape(name)}\][ \t]*\n(.*?)^[ \t]*# \[END {re.escape(name)}\]",
        text,
        re.M | re.S,
    )
    if found is None:
        raise LookupError(f"no [START {name}] ... [END {name}] region")
    return textwrap.dedent(found.group(1))


def python_object(text: str, name: str) -> str:
    """The source of the function or class ``name`` (at any depth), decorators included."""
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and node.name == name
        ):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = text.splitlines(keepends=True)[first - 1 : node.end_lineno]
            return textwrap.dedent("".join(lines))
    raise LookupError(f"no def or class {name!r}")


_MARKER_LINE = re.compile(r"^[ \t]*# \[(?:START|END) [\w.-]+\][ \t]*\n", re.M)


def expected(quote: Quote) -> str:
    """What ``quote`` must show: its source's region or object, ending in one newline, without
    the marker lines of other regions inside it."""
    text = quote.source.read_text(encoding="utf-8")
    body = region(text, quote.name) if quote.kind == "region" else python_object(text, quote.name)
    return _MARKER_LINE.sub("", body).strip("\n") + "\n"


def problems(pages: Iterable[Path] = PAGES) -> list[str]:
    """Every quoted block that differs from its source, or whose source is missing."""
    found = []
    for page in pages:
        for quote in quotes(page):
            try:
                if quote.shown != expected(quote):
                    found.append(f"{quote.label}: differs from the source")
            except (OSError, LookupError) as exc:
                found.append(f"{quote.label}: {exc}")
    return found


def write(pages: Iterable[Path] = PAGES) -> list[Path]:
    """Rewrite every drifted block from its source; the pages changed."""
    changed = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        new = text
        for quote in reversed(quotes(page, text)):  # from the end: offsets stay valid
            new = new[: quote.start] + expected(quote) + new[quote.end :]
        if new != text:
            page.write_text(new, encoding="utf-8")
            changed.append(page)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite drifted blocks")
    args = parser.parse_args(argv)
    if args.write:
        for page in write():
            print(f"rewrote {_shown(page)}")
    left = problems()
    for problem in left:
        print(problem, file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
