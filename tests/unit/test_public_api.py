"""The public API and the provider's edges, read from the code itself (no Airflow run):

- ``airflow_idempotency.__all__`` names what users need, each name resolves, and nothing
  else is offered at the top level;
- the rest of the public API is what the API reference (docs/api.md) documents by its
  module's path (``airflow_idempotency.records.Trigger``): each of those resolves too;
- the example DAGs (``dags/``) import only public names;
- no import cycle inside the provider (lazy imports in functions count too);
- every third-party module the provider imports is a declared dependency, or the web
  framework of one Airflow line, imported only by that line's view.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import airflow_idempotency
from support import ROOT

PACKAGE = ROOT / "provider" / "airflow_idempotency"
PUBLIC = set(airflow_idempotency.__all__)
API_REFERENCE = ROOT / "docs" / "api.md"
# What users need is a short list; the rest of the API is imported from its module.
MAX_PUBLIC = 28

# The web framework of each Airflow line is Airflow's own, not a requirement of ours: the
# view's module for the line imports it, and Airflow loads that module only on its line.
LINE_FRAMEWORKS = {
    "fastapi": {"ui/app.py", "ui/dependencies.py", "ui/errors.py", "ui/routes.py"},
    "starlette": {"ui/app.py", "ui/errors.py"},
    "flask": {"ui/fab.py"},
    "flask_appbuilder": {"ui/fab.py"},
    "flask_wtf": {"ui/fab.py"},
}
AIRFLOW_ITSELF = {"apache-airflow", "apache-airflow-core", "apache-airflow-task-sdk"}


def test_every_public_name_resolves_and_nothing_else_is_offered() -> None:
    """Each name of ``__all__`` is an object of the provider; ``dir()`` lists just them; any
    other name is an AttributeError that names it."""
    assert len(airflow_idempotency.__all__) == len(PUBLIC)  # no name twice
    assert set(airflow_idempotency._EXPORTS) == PUBLIC - {"__version__"}  # each one lazily
    for name in PUBLIC - {"__version__"}:
        value = getattr(airflow_idempotency, name)
        assert value.__module__.startswith("airflow_idempotency."), (name, value.__module__)
    assert sorted(dir(airflow_idempotency)) == sorted(PUBLIC)
    with pytest.raises(AttributeError, match="'hold_run_lock'"):
        airflow_idempotency.hold_run_lock  # noqa: B018 (a module-level name, not public)


_DOCUMENTED = re.compile(
    r"^\.\. auto(?:class|function|exception|data|attribute)::\s+"
    r"airflow_idempotency\.(?P<module>[\w.]+)\.(?P<name>\w+)\b",
    re.MULTILINE,
)


def documented_in_modules(reference: str) -> dict[str, set[str]]:
    """Module -> the names the API reference ``reference`` documents by that module's path
    (``.. autoclass:: airflow_idempotency.records.Trigger``: ``records`` -> ``Trigger``)."""
    found: dict[str, set[str]] = {}
    for match in _DOCUMENTED.finditer(reference):
        found.setdefault(f"airflow_idempotency.{match['module']}", set()).add(match["name"])
    return found


IN_MODULES = documented_in_modules(API_REFERENCE.read_text(encoding="utf-8"))


def test_the_public_api_is_short_and_the_rest_is_documented_by_its_module() -> None:
    """``__all__`` stays a short list; each name the API reference documents by its module
    resolves there, in a module that is not private, and is not in ``__all__`` as well."""
    assert len(PUBLIC) <= MAX_PUBLIC, sorted(PUBLIC)
    assert sum(map(len, IN_MODULES.values())) >= 15, IN_MODULES  # the reference was read
    for module, names in IN_MODULES.items():
        assert not any(part.startswith("_") for part in module.split(".")), module
        for name in names:
            assert name not in PUBLIC, f"{name}: documented as {module}.{name} and public"
            value = getattr(importlib.import_module(module), name)
            assert value.__module__.startswith("airflow_idempotency."), (name, value)


def provider_imports(source: str) -> Iterator[tuple[str, list[str]]]:
    """(module, names) of each import of the provider in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "airflow_idempotency":
                yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "airflow_idempotency":
                    yield alias.name, []


def non_public(source: str) -> list[str]:
    """The imports of ``source`` that reach past the public API: a top-level name not in
    ``__all__``, or a module's name that the API reference does not document there."""
    problems = []
    for module, names in provider_imports(source):
        if module == "airflow_idempotency":
            if unknown := [n for n in names if n not in PUBLIC]:
                problems.append(f"imports {', '.join(unknown)}: not in airflow_idempotency.__all__")
        elif not names:
            problems.append(f"imports the module {module}: import its names")
        elif unknown := [n for n in names if n not in IN_MODULES.get(module, set())]:
            problems.append(
                f"imports {', '.join(unknown)} from {module}: not in the API reference "
                "(docs/api.md) by that path"
            )
    return problems


def test_the_example_dags_import_only_public_names() -> None:
    files = sorted((ROOT / "dags").rglob("*.py"))
    assert len(files) >= 6, files
    problems = [
        f"{path.relative_to(ROOT)}: {problem}"
        for path in files
        for problem in non_public(path.read_text(encoding="utf-8"))
    ]
    assert not problems, "\n".join(problems)
    used = {n for p in files for _, names in provider_imports(p.read_text()) for n in names}
    assert {"IdempotentRunOperator", "OutboundLedger", "RunContext"} <= used, used


def test_the_public_name_check_catches_a_private_import() -> None:
    source = (
        "from airflow_idempotency.locks import named_lock_key\n"
        "from airflow_idempotency import RunContext, hold_run_lock\n"
        "from airflow_idempotency.records import Trigger, RunRecords\n"
        "from airflow_idempotency.operator import conf_flag\n"
        "def f():\n    import airflow_idempotency.compat\n"
    )
    problems = non_public(source)
    assert len(problems) == 4, problems
    assert "named_lock_key from airflow_idempotency.locks: not in the API" in problems[0]
    assert "hold_run_lock: not in" in problems[1]
    assert "imports RunRecords from airflow_idempotency.records: not in" in problems[2]
    assert "imports the module airflow_idempotency.compat" in problems[3]


def test_the_reference_reader_finds_names_by_their_module() -> None:
    reference = (
        "```{eval-rst}\n"
        ".. autoclass:: airflow_idempotency.RunContext()\n"
        "   :members:\n"
        ".. autoclass:: airflow_idempotency.records.Trigger\n"
        ".. autofunction:: airflow_idempotency.ui.app.create_app\n"
        ".. autoexception:: airflow_idempotency.exceptions.SchemaError\n"
        "```\n"
    )
    assert documented_in_modules(reference) == {
        "airflow_idempotency.records": {"Trigger"},
        "airflow_idempotency.ui.app": {"create_app"},
        "airflow_idempotency.exceptions": {"SchemaError"},
    }


def _module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import that can run: at module level or in a function (a lazy import), not
    under ``if TYPE_CHECKING`` (type checkers only)."""
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(child) for child in ast.walk(node)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only:
            yield node


def import_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the provider modules it imports (``files``: module -> source)."""
    graph: dict[str, set[str]] = {}
    for module, source in files.items():
        targets: set[str] = set()
        for node in _imports(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif node.level == 0 and node.module:
                # `from pkg import mod` imports the module pkg.mod (pkg is imported before
                # any of its modules anyway); `from mod import name` imports mod.
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = [s for s in subs if s in files]
                if len(names) < len(subs):
                    names.append(node.module)
            else:
                continue
            targets |= {n for n in names if n in files and n != module}
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle of ``graph`` (one per strongly connected set of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _provider_sources() -> dict[str, str]:
    return {_module_of(p): p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py")}


def test_the_provider_has_no_import_cycle() -> None:
    sources = _provider_sources()
    graph = import_graph(sources)
    assert len(graph) >= 40 and sum(map(len, graph.values())) >= 60, "the graph is too small"
    assert cycles(graph) == []


def test_the_cycle_check_catches_a_cycle() -> None:
    found = cycles(
        import_graph(
            {
                "p.a": "from p.b import x\n",
                "p.b": "import p.c\nfrom typing import TYPE_CHECKING\nfrom p import e\n",
                "p.e": "from p.d import z\n",
                "p.c": "from p import a\n",
                "p": "",
                "p.d": "if TYPE_CHECKING:\n    from p.a import y\n",
                "p.f": "def f():\n    from p.g import z\n",
                "p.g": "def g():\n    import p.f\n",
            }
        )
    )
    assert sorted(found) == [["p.a", "p.b", "p.c"], ["p.f", "p.g"]], found


def _declared() -> set[str]:
    requirement = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
    names = set()
    for line in importlib.metadata.requires("airflow-provider-idempotency") or []:
        if "extra ==" in line:
            continue
        match = requirement.match(line)
        assert match, line
        names.add(re.sub(r"[-_.]+", "-", match.group(1)).lower())
    return names


def test_every_third_party_import_of_the_provider_is_declared() -> None:
    """Anywhere in the provider, in a function too: each third-party module comes from a
    requirement of pyproject.toml (Airflow itself for ``airflow``), or is a line's web
    framework imported only by that line's view."""
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "airflow_idempotency":
                    continue
                if top in LINE_FRAMEWORKS:
                    if where not in LINE_FRAMEWORKS[top]:
                        problems.append(f"{where}: {module} outside its line's view")
                    continue
                dists = {d.lower() for d in distributions.get(top, [])}
                if top == "airflow":
                    if module.startswith("airflow.providers."):
                        # airflow.providers.smtp.hooks -> apache-airflow-providers-smtp,
                        # airflow.providers.common.compat.sdk -> ...-common-compat
                        parts = module.split(".")[2:]
                        dists = {
                            "apache-airflow-providers-" + "-".join(parts[:n]).replace("_", "-")
                            for n in (1, 2)
                        }
                    else:
                        dists &= AIRFLOW_ITSELF
                        if dists:
                            continue  # Airflow itself: apache-airflow
                if not dists & declared:
                    problems.append(f"{where}: {module} ({sorted(dists) or 'not installed'})")
    assert not problems, "undeclared:\n" + "\n".join(sorted(set(problems)))


# What a task's DAG file pays for importing us: Airflow's task SDK and the libraries every run
# uses are there anyway; the rest is loaded by the code that needs it, when it does.
_IMPORTS_OF_A_TASK = """
import json, sys
import airflow.sdk, airflow.providers.common.compat.sdk, pendulum, psycopg
before = set(sys.modules)
from airflow_idempotency import IdempotentRunOperator, idempotency_params, idempotent_run_task
print(json.dumps(sorted(set(sys.modules) - before)))
"""
# Provider modules a run key's decision needs (the operator, the decorator and the core).
_TASK_MODULES = {
    "airflow_idempotency",
    "airflow_idempotency._environ",  # the fault points' and the lock wait's variables
    "airflow_idempotency._sql",
    "airflow_idempotency._transactions",
    "airflow_idempotency.airflow_task",  # the operator's run mapping, shared with the policy
    "airflow_idempotency.arguments",
    "airflow_idempotency.compat",
    "airflow_idempotency.crashpoints",
    "airflow_idempotency.decorator",
    "airflow_idempotency.exceptions",
    "airflow_idempotency.fence",
    "airflow_idempotency.links",
    "airflow_idempotency.locks",
    "airflow_idempotency.metrics",
    "airflow_idempotency.migrator",
    "airflow_idempotency.operator",
    "airflow_idempotency.key_spelling",
    "airflow_idempotency.key_zone",
    "airflow_idempotency.lease_run",  # the lease lock mode's run, and its lease
    "airflow_idempotency.leases",
    "airflow_idempotency.partitions",
    "airflow_idempotency.provenance",
    "airflow_idempotency.provider_info",
    "airflow_idempotency.records",
    "airflow_idempotency.run_context",
    "airflow_idempotency.run_failures",
    "airflow_idempotency.run_key",
    "airflow_idempotency.run_key_rule",
    "airflow_idempotency.run_steps",
    "airflow_idempotency.runner",
    "airflow_idempotency.schema",
    "airflow_idempotency.step_watch",
    "airflow_idempotency.ui",  # its route constants only (the operator's link)
}


def test_importing_the_operator_loads_only_what_a_run_needs() -> None:
    """The ledger and its HTTP client, tenacity, the senders, rich, the CLI, the UI,
    planning, the watch, and the Postgres provider's hook (with psycopg2 and sqlparse) are
    imported by what uses them, not by a DAG file that imports the operator."""
    import json
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS_OF_A_TASK], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    ours = {m for m in loaded if m.split(".")[0] == "airflow_idempotency"}
    assert ours - _TASK_MODULES == set(), sorted(ours - _TASK_MODULES)
    assert "airflow_idempotency.operator" in ours  # it did import the provider
    third_party = {m.split(".")[0] for m in loaded} - {"airflow", "airflow_idempotency"}
    heavy = {"httpx", "tenacity", "rich", "aiosmtplib", "psycopg_pool", "psycopg2", "sqlparse"}
    assert third_party & heavy == set(), sorted(third_party)
    assert not [m for m in loaded if m.startswith("airflow.providers.postgres")], loaded
