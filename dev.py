#!/usr/bin/env python3
"""One entry point for a fresh clone: `python3 dev.py demo` and `python3 dev.py test`.

Needs only Python 3.11-3.12 (the lock files' Pythons) and git. Each command first makes sure the
project's virtual environment exists and matches its lock (creating it, installing uv
into it, syncing the locked packages, installing this checkout), then runs:

    python3 dev.py setup            only the set-up
    python3 dev.py test [ARGS]      the whole test suite (two sessions side by side), or pytest ARGS
    python3 dev.py demo [ARGS]      the guided demo of the invoice DAG
    python3 dev.py lint             ruff and mypy
    python3 dev.py cli ARGS         the airflow-idempotency CLI
    python3 dev.py bench [ARGS]     the benchmarks (figures and ratios, BENCHMARKS.md)
    python3 dev.py faults [ARGS]    the fault scenarios and their report (FAULTS.md)
    python3 dev.py chaos [ARGS]     seeded random actions and faults, checked against invariants
    python3 dev.py codemap [--check]  the code map of docs/development.md, from the docstrings

Airflow: the main line, 3.3, by default (.venv/, requirements/lock.txt). `--airflow LINE`
right after the command uses another line, each with its own venv and lock file:
`2` (Airflow 2.11: .venv-airflow2/, requirements/lock-airflow2.txt), `3.1`, `3.2`
(.venv-airflow3.N/, requirements/lock-airflow3.N.txt), `3.3` (= the default), or `floors`
(the lowest versions pyproject.toml declares for the providers: .venv-floors/,
requirements/lock-floors.txt), e.g. `python3 dev.py test --airflow 2` or
`python3 dev.py setup --airflow 3.1`. docs/airflow-lines.md says what each line gets.

dbt: the main line's set-up also makes .venv-dbt/ (requirements/lock-dbt.txt: dbt-core and
dbt-postgres, whose pins conflict with Airflow's), the dbt that astronomer-cosmos runs as a
subprocess in tests/stack/test_dbt_cosmos.py (docs/dbt.md); IDEMPOTENCY_DBT_EXECUTABLE names it.

PostgreSQL: IDEMPOTENCY_PG_DSN if set, else a server on 127.0.0.1:5432, else an embedded
server started from the `pgserver` wheel (data in .pgdata/). IDEMPOTENCY_PG=embedded
forces the embedded one.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# Bumped when the way packages are installed changes, so that existing venvs are redone.
SETUP_REVISION = b"3: the accounting service is its own distribution"


class Line:
    """One Airflow line: its virtual environment and its lock file."""

    def __init__(self, name: str, venv_dir: str, lock: str) -> None:
        self.name = name
        self.venv = ROOT / venv_dir
        self.bin = self.venv / ("Scripts" if os.name == "nt" else "bin")
        self.python = self.bin / "python"
        self.lock = ROOT / "requirements" / lock
        self.stamp = self.venv / ".installed-lock-sha256"


LINES = {
    "3.3": Line("Airflow 3.3", ".venv", "lock.txt"),
    "3.2": Line("Airflow 3.2", ".venv-airflow3.2", "lock-airflow3.2.txt"),
    "3.1": Line("Airflow 3.1", ".venv-airflow3.1", "lock-airflow3.1.txt"),
    "2": Line("Airflow 2.11", ".venv-airflow2", "lock-airflow2.txt"),
    "floors": Line("the declared floors", ".venv-floors", "lock-floors.txt"),
}
# dbt in an environment of its own (no Airflow, no checkout), set up with the main line.
DBT = Line("dbt, run by astronomer-cosmos", ".venv-dbt", "lock-dbt.txt")
# Other names of the same lines.
ALIASES = {"3": "3.3", "2.11": "2"}


def say(message: str) -> None:
    print(f"[setup] {message}", flush=True)


def fail(message: str, fix: str) -> None:
    print(f"[setup] FAILED: {message}\n[setup] fix: {fix}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def run(cmd: list[str], what: str, fix: str) -> None:
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-25:])
        fail(f"{what} ({' '.join(cmd[:4])} ... exited {result.returncode}):\n{tail}", fix)


def setup(line: Line) -> None:
    """Create or refresh the line's venv so that it holds exactly its locked packages."""
    if not (3, 11) <= sys.version_info[:2] <= (3, 12):
        fail(
            f"Python {sys.version.split()[0]} is not supported (the lock files are compiled "
            "for 3.11 and pin packages that need it; the embedded PostgreSQL wheel needs 3.12 "
            "at most)",
            "run this script with python3.11, e.g. `python3.11 dev.py test`",
        )
    digest = hashlib.sha256(
        SETUP_REVISION
        + line.lock.read_bytes()
        + (ROOT / "pyproject.toml").read_bytes()
        + (ROOT / "accounting" / "pyproject.toml").read_bytes()
    ).hexdigest()
    if line.python.exists() and line.stamp.exists() and line.stamp.read_text().strip() == digest:
        return
    if not line.python.exists():
        say(f"creating the virtual environment {line.venv.relative_to(ROOT)}/ ({line.name}) ...")
        try:
            venv.EnvBuilder(with_pip=True, clear=line.venv.exists()).create(line.venv)
        except Exception as exc:
            fail(
                f"could not create {line.venv}: {exc}",
                "install your Python's venv module (Debian: apt-get install python3-venv)",
            )
    say("installing uv (the package installer) ...")
    run(
        [
            str(line.python),
            *("-m", "pip", "install", "--quiet", "--disable-pip-version-check", "uv>=0.4"),
        ],
        "pip could not install uv",
        "check that PyPI is reachable (proxy settings, PIP_INDEX_URL)",
    )
    packages = sum(
        1
        for text in line.lock.read_text().splitlines()
        if "==" in text and not text.startswith("#")
    )
    lock_name = line.lock.relative_to(ROOT)
    say(f"installing {packages} locked packages from {lock_name} (a minute or so) ...")
    uv = [str(line.bin / "uv"), "pip"]
    env_python = ["--python", str(line.python)]
    # --compile-bytecode: uv does not write .pyc files by default, and where
    # PYTHONDONTWRITEBYTECODE is set (as on our CI machines) no process ever would, so every
    # Airflow process would compile thousands of modules again (psycopg: 260 ms -> 70 ms).
    run(
        [*uv, "sync", *env_python, "--compile-bytecode", str(line.lock)],
        "installing the locked packages failed",
        "check network access to PyPI; delete .venv/ and try again",
    )
    say(
        "installing this checkout (editable: the provider and the example's accounting service) ..."
    )
    run(
        [*uv, "install", *env_python, "--no-deps", "-e", ".", "-e", "accounting"],
        "installing the project failed",
        "delete .venv/ and try again",
    )
    line.stamp.write_text(digest)
    say(f"environment ready ({line.name})")


def setup_dbt(installer: Line) -> None:
    """Create or refresh .venv-dbt/ with exactly requirements/lock-dbt.txt, with the uv of
    ``installer`` (a line set up already): a venv without pip, a few seconds."""
    digest = hashlib.sha256(SETUP_REVISION + DBT.lock.read_bytes()).hexdigest()
    if DBT.python.exists() and DBT.stamp.exists() and DBT.stamp.read_text().strip() == digest:
        return
    if not DBT.python.exists():
        say(f"creating the virtual environment {DBT.venv.relative_to(ROOT)}/ ({DBT.name}) ...")
        try:
            venv.EnvBuilder(with_pip=False, clear=DBT.venv.exists()).create(DBT.venv)
        except Exception as exc:
            fail(
                f"could not create {DBT.venv}: {exc}",
                "install your Python's venv module (Debian: apt-get install python3-venv)",
            )
    say(f"installing dbt from {DBT.lock.relative_to(ROOT)} ...")
    run(
        [
            str(installer.bin / "uv"), "pip", "sync", "--python", str(DBT.python),
            "--compile-bytecode", str(DBT.lock),
        ],
        "installing dbt's locked packages failed",
        "check network access to PyPI; delete .venv-dbt/ and try again",
    )  # fmt: skip
    DBT.stamp.write_text(digest)
    say(f"environment ready ({DBT.name})")


def venv_env(line: Line) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{line.bin}{os.pathsep}{env.get('PATH', '')}"
    # This checkout's provider and accounting service come first: a venv shared by several
    # checkouts (worktrees) holds an editable install of whichever ran setup last.
    env["PYTHONPATH"] = os.pathsep.join(
        p
        for p in (
            str(ROOT / "provider"),
            str(ROOT / "accounting"),
            str(ROOT),
            str(ROOT / "dags"),
            env.get("PYTHONPATH"),
        )
        if p
    )
    # Tests that need the other line's environment (a worker of each, side by side) find it
    # here; it exists once `python3 dev.py setup --airflow 2` has run.
    env.setdefault("IDEMPOTENCY_AIRFLOW2_PYTHON", str(LINES["2"].python))
    env.setdefault("IDEMPOTENCY_AIRFLOW3_PYTHON", str(LINES["3.3"].python))
    # The dbt that cosmos runs (tests/dags_dbt/dbt_shop.py), made with the main line.
    env.setdefault("IDEMPOTENCY_DBT_EXECUTABLE", str(DBT.bin / "dbt"))
    return env


def exec_in_venv(line: Line, args: list[str]) -> None:
    env = venv_env(line)
    os.chdir(ROOT)
    os.execve(str(line.python), [str(line.python), *args], env)


def test_in_two_sessions(line: Line) -> int:
    """The whole suite as two pytest sessions side by side: the tests that start Airflow's own
    processes (marked airflow_processes) one at a time, and the rest of the suite beside them
    (the core, the ledger, the view in process, the fault scenarios that drive Airflow in
    process: they wait mostly on PostgreSQL). Two Airflow stacks at once saturate a 2-core
    machine; one stack beside the rest leaves it about half idle. The second session's output
    follows the first's; the exit status is the first non-zero of the two."""
    env = venv_env(line)
    pytest = [str(line.python), "-m", "pytest"]
    with tempfile.NamedTemporaryFile("w+", prefix="dev-test-rest-", suffix=".log") as log:
        print(
            "[test] the whole suite, in two pytest sessions side by side: the tests that start "
            "Airflow processes (`-m airflow_processes`) here, the rest (`-m 'not "
            f"airflow_processes'`) beside them, its output after theirs ({log.name})",
            flush=True,
        )
        rest = subprocess.Popen(
            [*pytest, "-m", "not airflow_processes"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            processes = subprocess.call([*pytest, "-m", "airflow_processes"], cwd=ROOT, env=env)
            print("[test] the tests that start Airflow processes: done; the rest ...", flush=True)
            others = rest.wait()
        finally:
            if rest.poll() is None:  # interrupted: stop the other session too
                rest.terminate()
                rest.wait()
        log.seek(0)
        sys.stdout.write(log.read())
    print(
        f"[test] the tests that start Airflow processes exited {processes}, the rest {others}",
        flush=True,
    )
    return processes or others


def main(argv: list[str]) -> None:
    command, rest = (argv[0], argv[1:]) if argv else ("help", [])
    if command in ("help", "-h", "--help"):
        print(__doc__)
        return
    if command not in (
        "setup",
        "test",
        "demo",
        "lint",
        "cli",
        "bench",
        "faults",
        "chaos",
        "codemap",
    ):
        print(f"unknown command {command!r}\n{__doc__}", file=sys.stderr)
        raise SystemExit(2)
    line = LINES["3.3"]
    if rest[:1] == ["--airflow"]:
        name = ALIASES.get(rest[1], rest[1]) if rest[1:] else ""
        if name not in LINES:
            print(
                f"--airflow takes one of {', '.join(LINES)} (2 is Airflow 2.11, 3 is 3.3), "
                f"not {rest[1] if rest[1:] else 'nothing'!r}",
                file=sys.stderr,
            )
            raise SystemExit(2)
        line, rest = LINES[name], rest[2:]
    setup(line)
    if line is LINES["3.3"]:
        setup_dbt(line)
    if command == "test" and not rest and line is LINES["3.3"]:
        raise SystemExit(test_in_two_sessions(line))
    if command == "test":
        exec_in_venv(line, ["-m", "pytest", *rest])
    elif command == "demo":
        exec_in_venv(line, ["-m", "devtools.demo", *rest])
    elif command == "lint":
        exec_in_venv(line, ["-m", "devtools.lint", *rest])
    elif command == "cli":
        exec_in_venv(line, ["-m", "airflow_idempotency.cli", *rest])
    elif command == "bench":
        exec_in_venv(line, ["-m", "bench", *rest])
    elif command == "faults":
        exec_in_venv(line, ["-m", "devtools.fault_report", *rest])
    elif command == "chaos":
        exec_in_venv(line, ["-m", "devtools.chaos", *rest])
    elif command == "codemap":
        exec_in_venv(line, ["-m", "devtools.codemap", *rest])


if __name__ == "__main__":
    main(sys.argv[1:])
