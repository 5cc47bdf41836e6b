"""The code stays in rooms of the right size, read from the code itself (``ast``):

- no function of the provider takes more than :data:`MAX_PARAMETERS` parameters (``self``
  and ``cls`` not counted; positional, keyword-only, ``*args`` and ``**kwargs`` all are);
- no function of the provider is longer than :data:`MAX_LINES` lines (its ``def`` line to its
  last line, docstring included, decorators not);
- no module of ``provider/`` or ``devtools/`` is longer than :data:`MAX_MODULE_LINES` lines;
- no class of ``provider/`` or ``devtools/`` is longer than :data:`MAX_CLASS_LINES` lines or
  defines more than :data:`MAX_CLASS_METHODS` methods (``def``s of its own body, properties
  and static methods included; inherited ones not).

Whatever has to be wider, longer or larger is allowed by name below, saying why; an allowed
one that is back within the limits fails the test until its entry is removed.

``python tests/unit/test_code_shape.py devtools`` prints the widest and longest functions and
the largest modules and classes of any folder (the figures this test enforces).
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
    # The Python API's keywords are what a script writes (lock_mode="lease", like the
    # operator's); its grouped settings (options, trigger, environment) are already objects.
    "runner.run_idempotently",
}
LONG_ALLOWED: set[str] = set()

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 350
MAX_CLASS_METHODS = 20
# The folders whose modules and classes are measured, and the package name they stand for.
MEASURED = {"provider/airflow_idempotency": "airflow_idempotency", "devtools": "devtools"}

# Qualified by package: "<package>.<module>" or "<package>.<module>.<class>", with the reason.
LARGE_ALLOWED: dict[str, str] = {}


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


@dataclass(frozen=True)
class Room:
    """A module or a class: its qualified name, lines and (for a class) methods."""

    name: str
    kind: str  # "module" or "class"
    lines: int
    methods: int
    where: str

    def over(self) -> str:
        """What of the ceilings it is over (``""`` when none)."""
        if self.kind == "module":
            return f"over {MAX_MODULE_LINES} lines" if self.lines > MAX_MODULE_LINES else ""
        over = []
        if self.lines > MAX_CLASS_LINES:
            over.append(f"over {MAX_CLASS_LINES} lines")
        if self.methods > MAX_CLASS_METHODS:
            over.append(f"over {MAX_CLASS_METHODS} methods")
        return " and ".join(over)

    def __str__(self) -> str:
        methods = f", {self.methods} methods" if self.kind == "class" else ""
        return f"{self.kind} {self.name} ({self.where}): {self.lines} lines{methods}"


def rooms(source: str, module: str, where: str = "") -> Iterator[Room]:
    """The module ``source`` and every class in it (nested ones too, named
    ``<module>.<outer names>.<name>``)."""
    tree = ast.parse(source)
    yield Room(module, "module", len(source.splitlines()), 0, where)

    def walk(node: ast.AST, prefix: str) -> Iterator[Room]:
        for child in ast.iter_child_nodes(node):
            name = f"{prefix}.{getattr(child, 'name', '')}"
            if isinstance(child, ast.ClassDef):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                methods = sum(
                    isinstance(c, ast.FunctionDef | ast.AsyncFunctionDef) for c in child.body
                )
                yield Room(name, "class", lines, methods, f"{where}:{child.lineno}")
                yield from walk(child, name)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from walk(child, name)
            else:
                yield from walk(child, prefix)

    yield from walk(tree, module)


def folder_rooms(folder: Path, package: str) -> list[Room]:
    """The modules and classes of the ``.py`` files below ``folder``, named from ``package``
    (``airflow_idempotency.ledger.outbound.OutboundLedger``)."""
    found: list[Room] = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        module = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
        where = path.relative_to(ROOT).as_posix()
        found += rooms(path.read_text(encoding="utf-8"), module, where)
    return found


def largest(found: list[Room], kind: str, n: int = 5) -> list[Room]:
    return sorted(
        (r for r in found if r.kind == kind), key=lambda r: (-r.lines, -r.methods, r.name)
    )[:n]


def size_problems(found: list[Room], allowed: dict[str, str]) -> str:
    """The modules and classes over a ceiling (and allowances no longer needed), with the
    largest of each, or ``""``."""
    problems = [f"{r.over()}: {r}" for r in found if r.over() and r.name not in allowed]
    by_name = {r.name: r for r in found}
    for name in sorted(allowed):
        room = by_name.get(name)
        if room is None or not room.over():
            problems.append(f"allowed to be large but {room or 'gone'}: remove {name!r}")
    if not problems:
        return ""
    return "\n".join(
        [
            *problems,
            "largest modules:",
            *(f"  {r}" for r in largest(found, "module")),
            "largest classes:",
            *(f"  {r}" for r in largest(found, "class")),
        ]
    )


def test_no_module_or_class_of_the_provider_or_devtools_is_too_large() -> None:
    found = [
        r for folder, package in MEASURED.items() for r in folder_rooms(ROOT / folder, package)
    ]
    modules = {r.name for r in found if r.kind == "module"}
    # the walk did reach both trees, packages inside them included
    assert {"airflow_idempotency.ledger.outbound", "devtools.chaos.run"} <= modules, modules
    assert sum(r.kind == "class" for r in found) > 100, len(found)
    for name, reason in LARGE_ALLOWED.items():
        assert len(reason) > 40, f"{name}: say why it may be large"
    problems = size_problems(found, LARGE_ALLOWED)
    assert not problems, problems


def test_the_size_check_catches_a_large_module_or_class() -> None:
    methods = "\n".join(f"    def m{i}(self): pass" for i in range(MAX_CLASS_METHODS + 1))
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    source = (
        f"class Many:\n{methods}\n"
        f"class Long:\n{body}\n"
        "def f():\n"
        "    class Inner:\n"
        "        def g(self): pass\n"
    )
    source += "\n" * (MAX_MODULE_LINES - len(source.splitlines()) + 1)
    found = list(rooms(source, "m"))
    sizes = {r.name: (r.kind, r.lines, r.methods) for r in found}
    assert sizes == {
        "m": ("module", MAX_MODULE_LINES + 1, 0),
        "m.Many": ("class", MAX_CLASS_METHODS + 2, MAX_CLASS_METHODS + 1),
        "m.Long": ("class", MAX_CLASS_LINES + 1, 0),
        "m.f.Inner": ("class", 2, 1),
    }, sizes
    problems = size_problems(found, {"m.Long": "allowed", "m.f.Inner": "not needed"}).splitlines()
    assert problems[:3] == [
        f"over {MAX_MODULE_LINES} lines: module m (): {MAX_MODULE_LINES + 1} lines",
        f"over {MAX_CLASS_METHODS} methods: class m.Many (:1): {MAX_CLASS_METHODS + 2} lines, "
        f"{MAX_CLASS_METHODS + 1} methods",
        "allowed to be large but class m.f.Inner (:"
        f"{MAX_CLASS_METHODS + MAX_CLASS_LINES + 5}): 2 lines, 1 methods: remove 'm.f.Inner'",
    ], problems
    assert problems[3] == "largest modules:", problems


if __name__ == "__main__":
    for folder in sys.argv[1:] or ["provider"]:
        found = folder_functions(ROOT / folder)
        print(f"{folder}: {len(found)} functions\nwidest:")
        print("\n".join(f"  {f}" for f in widest(found)))
        print("longest:")
        print("\n".join(f"  {f}" for f in longest(found)))
        sized = folder_rooms(ROOT / folder, Path(folder).name)
        print("largest modules:")
        print("\n".join(f"  {r}" for r in largest(sized, "module")))
        print("largest classes:")
        print("\n".join(f"  {r}" for r in largest(sized, "class")))
