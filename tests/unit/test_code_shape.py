"""The provider's functions stay narrow and short, read from the code itself (``ast``):

- no function takes more than :data:`MAX_PARAMETERS` parameters (``self`` and ``cls`` not
  counted; positional, keyword-only, ``*args`` and ``**kwargs`` all are);
- no function is longer than :data:`MAX_LINES` lines (its ``def`` line to its last line,
  docstring included, decorators not).

A function that has to be wider or longer is allowed by name below, saying why; an allowed
one that is back within the limits fails the test until its entry is removed.

``python tests/unit/test_code_shape.py devtools`` prints the widest and longest functions of any
folder (the figures this test enforces for ``provider/``).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "provider" / "airflow_idempotency"

MAX_PARAMETERS = 7
MAX_LINES = 60

# Qualified by module, from the package: "<module>.<class>.<function>".
WIDE_ALLOWED = {
    # An Airflow operator takes its settings as keyword arguments of its constructor (like
    # every operator of Airflow's own providers): they are what a DAG author writes.
    "operator.IdempotentRunOperator.__init__",
}
LONG_ALLOWED: set[str] = set()


@dataclass(frozen=True)
class Function:
    """One ``def`` of a source file: its qualified name, parameters and lines."""

    name: str
    parameters: int
    lines: int
    where: str

    def __str__(self) -> str:
        return f"{self.name} ({self.where}): {self.parameters} parameters, {self.lines} lines"


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    args = node.args
    named = [*args.posonlyargs, *args.args]
    static = any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)
    if in_class and not static and named and named[0].arg in ("self", "cls"):
        named = named[1:]
    starred = (args.vararg is not None) + (args.kwarg is not None)
    return len(named) + len(args.kwonlyargs) + starred


def functions(source: str, module: str, where: str = "") -> Iterator[Function]:
    """Every function of ``source`` (methods and nested functions too), named
    ``<module>.<outer names>.<name>``."""

    def walk(node: ast.AST, prefix: str) -> Iterator[Function]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}.{child.name}"
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                count = _parameters(child, isinstance(node, ast.ClassDef))
                yield Function(name, count, lines, f"{where}:{child.lineno}")
                yield from walk(child, name)
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}.{child.name}")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source), module)


def folder_functions(folder: Path, package: str | None = None) -> list[Function]:
    """Every function of the ``.py`` files below ``folder``; module names are relative to
    it (``ui.reads``), with ``package`` in front when given."""
    found: list[Function] = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"
        if package:
            module = f"{package}.{module}"
        where = path.relative_to(ROOT).as_posix()
        found += functions(path.read_text(encoding="utf-8"), module, where)
    return found


def widest(found: list[Function], n: int = 5) -> list[Function]:
    return sorted(found, key=lambda f: (-f.parameters, -f.lines, f.name))[:n]


def longest(found: list[Function], n: int = 5) -> list[Function]:
    return sorted(found, key=lambda f: (-f.lines, -f.parameters, f.name))[:n]


def shape_problems(found: list[Function], wide_allowed: set[str], long_allowed: set[str]) -> str:
    """What breaks the limits (and allowances no longer needed), with the widest and
    longest functions, or ``""``."""
    problems = [
        f"over {MAX_PARAMETERS} parameters: {f}"
        for f in found
        if f.parameters > MAX_PARAMETERS and f.name not in wide_allowed
    ]
    problems += [
        f"over {MAX_LINES} lines: {f}"
        for f in found
        if f.lines > MAX_LINES and f.name not in long_allowed
    ]
    by_name = {f.name: f for f in found}
    for allowed, over in ((wide_allowed, "wide"), (long_allowed, "long")):
        for name in sorted(allowed):
            f = by_name.get(name)
            within = f is None or (
                f.parameters <= MAX_PARAMETERS if over == "wide" else f.lines <= MAX_LINES
            )
            if within:
                problems.append(f"allowed to be {over} but {f or 'gone'}: remove {name!r}")
    if not problems:
        return ""
    return "\n".join(
        [
            *problems,
            "widest:",
            *(f"  {f}" for f in widest(found)),
            "longest:",
            *(f"  {f}" for f in longest(found)),
        ]
    )


def test_no_function_of_the_provider_is_too_wide_or_too_long() -> None:
    found = folder_functions(PACKAGE)
    assert len(found) > 300, len(found)  # the walk did reach the whole package
    problems = shape_problems(found, WIDE_ALLOWED, LONG_ALLOWED)
    assert not problems, problems


def test_the_shape_check_catches_a_wide_or_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    source = (
        "def wide(a, b, c, d, /, e, f, *g, h, **i): pass\n"
        "class C:\n"
        "    def method(self, a, b, c, d, e, f, g): pass\n"
        "    @staticmethod\n"
        "    def static(self, a, b, c, d, e, f, g): pass\n"
        "    def outer(cls):\n"
        "        async def inner(a, b, c, *, d, e, f, g, h): pass\n"
        f"def long():\n{body}\n"
    )
    found = list(functions(source, "m"))
    counts = {f.name: (f.parameters, f.lines) for f in found}
    assert counts == {
        "m.wide": (9, 1),
        "m.C.method": (7, 1),
        "m.C.static": (8, 1),
        "m.C.outer": (0, 2),
        "m.C.outer.inner": (8, 1),
        "m.long": (0, MAX_LINES + 1),
    }, counts
    problems = shape_problems(found, {"m.C.static", "m.C.method"}, set()).splitlines()
    assert problems[:4] == [
        "over 7 parameters: m.wide (:1): 9 parameters, 1 lines",
        "over 7 parameters: m.C.outer.inner (:7): 8 parameters, 1 lines",
        f"over 60 lines: m.long (:8): 0 parameters, {MAX_LINES + 1} lines",
        "allowed to be wide but m.C.method (:3): 7 parameters, 1 lines: remove 'm.C.method'",
    ], problems
    assert problems[4] == "widest:" and problems[5].startswith("  m.wide "), problems


if __name__ == "__main__":
    for folder in sys.argv[1:] or ["provider"]:
        found = folder_functions(ROOT / folder)
        print(f"{folder}: {len(found)} functions\nwidest:")
        print("\n".join(f"  {f}" for f in widest(found)))
        print("longest:")
        print("\n".join(f"  {f}" for f in longest(found)))
