"""`python3 dev.py faults`: run the fault scenarios and write FAULTS.md.

    python -m devtools.fault_report                 # tests/faults/test_faults_*.py, slow ones too
    python -m devtools.fault_report -m "not slow"   # extra arguments go to pytest
    python -m devtools.fault_report --output /tmp/FAULTS.md

Runs pytest on the fault test files with a JUnit XML report in a temporary file, then
writes one table per file: each scenario, the one-sentence docstring of its test (what it
proves), its outcome and duration, and the figures the test printed (lines starting with
``[figures]``). The header says how, when and on what it ran. Exits with pytest's status.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests" / "faults"
PATTERN = "test_faults_*.py"
DEFAULT_OUTPUT = ROOT / "FAULTS.md"
FIGURES = re.compile(r"^\[figures\] (.*)$", re.MULTILINE)


@dataclass
class Case:
    """One test (one parametrized id) as the JUnit report tells it."""

    file: str
    name: str
    outcome: str
    seconds: float
    message: str = ""
    figures: list[str] = field(default_factory=list)
    properties: dict[str, str] = field(default_factory=dict)

    @property
    def function(self) -> str:
        return self.name.split("[", 1)[0]

    @property
    def param(self) -> str:
        return self.name[len(self.function) + 1 : -1] if "[" in self.name else ""


def docstrings(path: Path) -> tuple[str, dict[str, str]]:
    """The module docstring's first paragraph and each test function's docstring, by name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = (ast.get_docstring(tree) or "").split("\n\n", 1)[0].replace("\n", " ")
    tests = {
        node.name: " ".join((ast.get_docstring(node) or "").split())
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }
    return module, tests


def parse_junit(path: Path) -> list[Case]:
    """The test cases of a pytest JUnit XML file, with outcome, figures and properties."""
    cases = []
    for element in ET.parse(path).getroot().iter("testcase"):
        file = element.get("file") or element.get("classname", "").replace(".", "/") + ".py"
        outcome, message = "passed", ""
        for child in element:
            if child.tag in ("failure", "error"):
                outcome, message = (
                    ("failed" if child.tag == "failure" else "error"),
                    child.get("message", ""),
                )
            elif child.tag == "skipped":
                kind = child.get("type", "")
                outcome = "xfailed" if kind == "pytest.xfail" else "skipped"
                message = child.get("message", "")
        out = "".join(node.text or "" for node in element.iter("system-out"))
        properties = {
            prop.get("name", ""): prop.get("value", "") for prop in element.iter("property")
        }
        cases.append(
            Case(
                file=Path(file).name,
                name=element.get("name", "?"),
                outcome=outcome,
                seconds=float(element.get("time") or 0),
                message=message,
                figures=FIGURES.findall(out),
                properties=properties,
            )
        )
    return cases


def _first_line(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return (done.stdout or done.stderr).strip().splitlines()[0] if done.returncode == 0 else "?"


def postgres_versions() -> dict[str, str]:
    """The version of the server the tests use, and of the embedded one (private servers)."""
    versions: dict[str, str] = {}
    try:
        import psycopg

        from devtools.postgres import find_server

        server = find_server()
        try:
            with psycopg.connect(server.admin_dsn) as conn:
                row = conn.execute("SELECT version()").fetchone()
            versions[f"{server.source} server"] = str(row[0]).split(" on ")[0] if row else "?"
        finally:
            server.close()
    except Exception as exc:  # the report says what it could not find
        versions["server"] = f"unknown ({type(exc).__name__}: {exc})"
    try:
        from pgserver._commands import POSTGRES_BIN_PATH

        line = _first_line([str(POSTGRES_BIN_PATH / "postgres"), "--version"])
        number = re.search(r"\d+(\.\d+)*", line)
        versions["embedded pgserver (private servers of the storm and restart scenarios)"] = (
            f"PostgreSQL {number.group(0)}" if number else line
        )
    except ImportError:
        versions["embedded (pgserver)"] = "not installed"
    return versions


def machine() -> dict[str, str]:
    import importlib.metadata as md

    info = {
        "host": f"{platform.system()} {platform.release()} {platform.machine()}",
        "nproc": str(os.cpu_count()),
        "python": platform.python_version(),
    }
    for dist in ("apache-airflow", "psycopg", "hypothesis"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = "not installed"
    return info


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def render(
    cases: list[Case],
    *,
    command: str,
    started: dt.datetime,
    seconds: float,
    exit_code: int,
    info: dict[str, str],
    versions: dict[str, str],
    load: tuple[tuple[float, ...], tuple[float, ...]],
) -> str:
    """FAULTS.md."""
    totals = Counter(case.outcome for case in cases)
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(totals.items()))
    out = [
        "# Fault scenarios",
        "",
        "Generated by `python3 dev.py faults` (`devtools/fault_report.py`): do not edit by "
        "hand, re-run it to refresh. Each row is one test; *what it proves* is the test's "
        "docstring, *figures* what it measured.",
        "",
        f"- Command: `{command}`",
        f"- Date: {started:%Y-%m-%d %H:%M} UTC; wall time {seconds / 60:.1f} min; "
        f"pytest exit status {exit_code}",
        "- Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()),
        "- PostgreSQL: " + "; ".join(f"{k}: {v}" for k, v in versions.items()),
        f"- Load average (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in load[0])}, "
        f"at end {'/'.join(f'{x:.1f}' for x in load[1])}: other developers share this "
        "machine, so durations vary between runs.",
        f"- Result: **{summary or 'no tests ran'}**",
        "",
        "Outcomes: *passed*; *xfailed* = a provider bug found by these scenarios, pinned by "
        "a strict xfail test (the reason says what is wrong; the test starts passing, and "
        "fails as XPASS, once the bug is fixed); *failed* needs looking at.",
        "",
    ]
    by_file: dict[str, list[Case]] = {}
    for case in cases:
        by_file.setdefault(case.file, []).append(case)
    for file in sorted(by_file):
        path = TESTS / file
        module_doc, test_docs = docstrings(path) if path.exists() else ("", {})
        out += [f"## {file}", "", module_doc, ""]
        out += [
            "| scenario | what it proves | outcome | time | figures |",
            "|---|---|---|---:|---|",
        ]
        for case in by_file[file]:
            scenario = f"`{case.function}`" + (f" `[{case.param}]`" if case.param else "")
            figures = list(case.figures)
            figures += [f"{k} = {v}" for k, v in case.properties.items()]
            outcome = case.outcome
            if case.outcome == "xfailed" and case.message:
                outcome += f": {case.message}"  # the bug, as the strict xfail states it
            elif case.outcome != "passed" and case.message:
                outcome += f": {case.message[:600]}"
            out.append(
                "| "
                + " | ".join(
                    _cell(c)
                    for c in (
                        scenario,
                        test_docs.get(case.function, ""),
                        outcome,
                        f"{case.seconds:.1f} s",
                        "; ".join(figures),
                    )
                )
                + " |"
            )
        out.append("")
    if any(c.file == "test_faults_crash_matrix.py" for c in cases):
        out += [
            "The crash-matrix scenarios run two at a time in the background from the start "
            "of their module, so a row's *time* is how long its test waited; the real "
            "worker times (crash worker ... s, rerun ... s) are in its figures.",
            "",
        ]
    return "\n".join(out)


def keep_chaos_section(path: Path, report: str) -> str:
    """``report`` with the chaos section of the existing ``path`` (devtools/chaos/ writes
    it from a long run, which this command does not repeat) appended."""
    from devtools.chaos.report import CHAOS_BEGIN, CHAOS_END

    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if CHAOS_BEGIN not in old or CHAOS_END not in old:
        return report
    section = CHAOS_BEGIN + old.split(CHAOS_BEGIN, 1)[1].split(CHAOS_END, 1)[0] + CHAOS_END
    return report.rstrip("\n") + "\n\n" + section + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="default FAULTS.md")
    args, pytest_args = parser.parse_known_args(argv)
    files = sorted(str(p.relative_to(ROOT)) for p in TESTS.glob(PATTERN) if docstrings(p)[1])
    with tempfile.TemporaryDirectory(prefix="fault-report-") as tmp:
        junit = Path(tmp) / "faults.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *files,
            f"--junitxml={junit}",
            "-o",
            "junit_logging=system-out",
            "-p",
            "no:cacheprovider",
            "-q",
            *pytest_args,
        ]
        shown = "python -m pytest " + " ".join(
            shlex.quote(a) for a in cmd[3:] if not a.startswith("--junitxml")
        )
        print(f"$ {shown}", flush=True)
        started = dt.datetime.now(dt.timezone.utc)
        load_start = os.getloadavg()
        began = time.monotonic()
        exit_code = subprocess.run(cmd, cwd=ROOT, check=False).returncode
        seconds = time.monotonic() - began
        load_end = os.getloadavg()
        cases = parse_junit(junit) if junit.exists() else []
    report = render(
        cases,
        command=shown + "  (plus --junitxml into a temporary file)",
        started=started,
        seconds=seconds,
        exit_code=exit_code,
        info=machine(),
        versions=postgres_versions(),
        load=(load_start, load_end),
    )
    report = keep_chaos_section(args.output, report)
    args.output.write_text(report, encoding="utf-8")
    print(f"wrote {args.output} ({len(cases)} scenarios, pytest exit status {exit_code})")
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
