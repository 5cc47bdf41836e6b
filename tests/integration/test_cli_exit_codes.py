"""docs/cli.md's table of exit codes, row by row: each row is a case here, run against a real
job database (and, for the DAG commands, the test DAGs parsed in process through Airflow).
The rows of `run` that need Airflow's own processes are cases of tests/stack/test_cli.py,
named below; a row without a case, or a case without a row, fails the table's test."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import airflow  # noqa: F401  (see below)
import pytest

from airflow_idempotency.cli import main
from support import ROOT
from support.cli import abandon, record
from support.effects import seed_ledger
from support.locks import key_held, run_lock_taken
from support.workers import TEST_DAGS

# Airflow configures its log handlers when first imported, on the sys.stderr of that moment.
# Imported here, that is the session's; first imported inside a test's capsys, the handlers
# would write to that test's stream once it is closed, and every later log line (a warning a
# plugin logs when the `plan` command loads it) would print a "Logging error" traceback.

pytestmark = pytest.mark.both_airflow_lines

# Nothing listens on port 1; connect_timeout bounds the wait where a firewall drops instead.
UNREACHABLE = "host=127.0.0.1 port=1 dbname=jobs user=nobody connect_timeout=5"
DAGS = ("--dags-folder", str(TEST_DAGS))

Setup = Callable[[str], AbstractContextManager[object]]


@contextlib.contextmanager
def nothing(dsn: str) -> Iterator[None]:
    """A database without the bookkeeping tables (no task ever ran against it)."""
    yield


@contextlib.contextmanager
def records(dsn: str) -> Iterator[None]:
    """Job j: 10-01 completed, 10-02 failed; 10-03 never ran."""
    record(dsn, "j", "2026-10-01")
    record(dsn, "j", "2026-10-02", fail=True)
    yield


@contextlib.contextmanager
def abandoned(dsn: str) -> Iterator[None]:
    """A worker killed after it started 10-04: the key is started, nobody holds its lock."""
    with records(dsn):
        abandon(dsn, "j", "2026-10-04")
        yield


@contextlib.contextmanager
def running(dsn: str) -> Iterator[None]:
    """A run of j 10-02 holding its lock while the command runs."""
    with records(dsn), key_held(dsn, "j", "2026-10-02"):
        yield


def seed_unknown(dsn: str) -> None:
    """An email of job j 10-01 whose call began and has no outcome: unknown."""
    seed_ledger(dsn, "j", [("finance_mail", "mail:1", "unknown", "email", False, None)])


@contextlib.contextmanager
def unknown_effect(dsn: str) -> Iterator[None]:
    with records(dsn):
        seed_unknown(dsn)
        yield


@contextlib.contextmanager
def unknown_effect_locked(dsn: str) -> Iterator[None]:
    """The unknown email, while an attempt of its key (j 10-01) holds the run lock."""
    seed_unknown(dsn)
    with run_lock_taken(dsn, "j", "2026-10-01"):
        yield


@dataclass(frozen=True)
class Case:
    """A command line (``--dsn`` of the case's database added), what the database holds while
    it runs, and words its output must contain."""

    argv: tuple[str, ...]
    setup: Setup = records
    says: str = ""
    unreachable: bool = False


CASES: dict[tuple[str, int], Case] = {
    ("runs", 0): Case(("runs",), says="2026-10-02"),
    ("runs", 1): Case(("runs", "--stale"), abandoned, says="2026-10-04"),
    ("runs", 2): Case(("runs", "--from", "2026-10-02", "--to", "2026-10-01"),
                      says="--from 2026-10-02 is after --to 2026-10-01"),
    ("runs", 69): Case(("runs",), nothing, says="has no bookkeeping tables"),
    ("show", 0): Case(("show", "j", "2026-10-01"), says="completed"),
    ("show", 1): Case(("show", "j", "2026-10-03"), says="no run recorded"),
    ("show", 2): Case(("show", "j\x00", "2026-10-01"), says="argument job:"),
    ("show", 69): Case(("show", "j", "2026-10-01"), unreachable=True,
                       says="cannot reach the job database"),
    ("locks", 0): Case(("locks",), says="held run locks"),
    ("locks", 2): Case(("locks", "--limit", "5"), says="unrecognized arguments: --limit 5"),
    ("locks", 69): Case(("locks",), nothing, says="has no bookkeeping tables"),
    ("ledger", 0): Case(("ledger",), says="outbound ledger"),
    ("ledger", 1): Case(("ledger",), unknown_effect, says="1 effect(s) unknown"),
    ("ledger", 2): Case(("ledger", "--key", "mail:1"), says="--key needs --remote"),
    ("ledger", 69): Case(("ledger",), unreachable=True, says="cannot reach the job database"),
    ("ledger", 75): Case(("ledger", "resend", "finance_mail", "mail:1", "--reason", "x", "--by", "a"),
                         unknown_effect_locked, says="Nothing resolved"),
    ("reset", 0): Case(("reset", "j", "2026-10-02", "--reason", "re-delivered"),
                       says="reset j 2026-10-02 to failed"),
    ("reset", 1): Case(("reset", "j", "2026-10-01", "--reason", "x"), says="nothing reset"),
    ("reset", 2): Case(("reset", "j", "2026-10-02", "--reason", " "), says="argument --reason:"),
    ("reset", 69): Case(("reset", "j", "2026-10-02", "--reason", "x"), unreachable=True,
                        says="cannot reach the job database"),
    ("reset", 75): Case(("reset", "j", "2026-10-02", "--reason", "x"), running,
                        says="is locked: a worker is running it now"),
    ("migrate", 0): Case(("migrate",), nothing, says="version 0 ->"),
    ("migrate", 2): Case(("migrate", "--schema", "Bad-Name"), says="argument --schema:"),
    ("migrate", 69): Case(("migrate",), unreachable=True, says="cannot reach the job database"),
    ("run", 2): Case(("run", "core_slow_job", "--date", "2026-13-01", *DAGS), says="YYYY-MM-DD"),
    ("run", 69): Case(("run", "core_slow_job", "--date", "2026-10-01", *DAGS),
                      unreachable=True, says="cannot reach the job database"),
    ("gaps", 0): Case(("gaps", "j", "--from", "2026-10-01", "--to", "2026-10-01"), says="none"),
    ("gaps", 1): Case(("gaps", "j", "--from", "2026-10-01", "--to", "2026-10-03"),
                      says="2026-10-03"),
    ("gaps", 2): Case(("gaps", "j", "--from", "2026-10-03", "--to", "2026-10-01"),
                      says="first key comes after the last"),
    ("gaps", 69): Case(("gaps", "j", "--from", "2026-10-01", "--to", "2026-10-03"), nothing,
                       says="has no bookkeeping tables"),
    ("prune", 0): Case(("prune", "--attempts-older-than", "400d"), says="deleted 0 attempt"),
    ("prune", 2): Case(("prune", "--attempts-older-than", "36501d"), says="1d to 36500d"),
    ("prune", 69): Case(("prune", "--attempts-older-than", "400d"), nothing,
                        says="has no bookkeeping tables"),
    ("explain", 0): Case(("explain", "core_slow_job", "--logical-date", "2026-10-02", *DAGS),
                         nothing, says="2026-10-01"),
    ("explain", 2): Case(("explain", "core_slow_job", "--conf", "[1]", *DAGS), nothing,
                         says="--conf must be a JSON object"),
    ("plan", 0): Case(("plan", "core_slow_job", "--from", "2026-10-02", "--to", "2026-10-03",
                       *DAGS), says="new"),
    ("plan", 2): Case(("plan", "core_slow_job", "--from", "2026-10-03", "--to", "2026-10-02",
                       *DAGS), says="is after --to"),
    ("plan", 69): Case(("plan", "core_slow_job", "--from", "2026-10-02", "--to", "2026-10-03",
                        *DAGS), unreachable=True, says="cannot reach the job database"),
    ("adopt", 2): Case(("adopt", "core_slow_job", "--from", "2026-10-03", "--to", "2026-10-02",
                        *DAGS), says="is after --to"),
    ("adopt", 69): Case(("adopt", "core_slow_job", "--from", "2026-10-02", "--to", "2026-10-03",
                         "--apply", *DAGS), unreachable=True, says="cannot reach the job database"),
}  # fmt: skip

# Rows whose case starts Airflow's processes (`airflow dags test`): tests of the stack tier.
STACK_CASES = {
    ("run", 0): "tests/stack/test_cli.py::test_run_exit_codes_through_airflow",
    ("run", 1): "tests/stack/test_cli.py::test_run_judges_a_task_mapped_over_segments_by_every_segment",
    ("run", 75): "tests/stack/test_cli.py::test_run_exit_codes_through_airflow",
    ("adopt", 0): "tests/stack/test_policy_stack.py::test_policy_and_adopt_on_airflow3",
}  # fmt: skip

# Rows whose case needs a set-up of another module's (an upgrade pending behind a reader).
OTHER_CASES = {
    ("migrate", 75): "tests/integration/test_migrations.py::"
    "test_migrate_exits_75_naming_the_blocker_when_it_waited_too_long",
}


def documented_rows() -> dict[tuple[str, int], str]:
    """(command, exit code) -> when, from docs/cli.md's per-command table."""
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    found = re.findall(r"^\| `([a-z]+)` \| (\d+) \| (.+) \|$", page, re.M)
    rows = {(command, int(code)): when for command, code, when in found}
    assert len(rows) == len(found), "a (command, code) row is written twice in docs/cli.md"
    return rows


def test_every_row_of_the_table_has_a_case_and_every_case_a_row() -> None:
    """docs/cli.md's exit codes per command are exactly the cases tested here and in the
    stack tier, every command of the CLI has its rows, and the stack cases exist."""
    from airflow_idempotency.cli import COMMANDS

    rows = documented_rows()
    assert set(rows) == set(CASES) | set(STACK_CASES) | set(OTHER_CASES)
    assert {command for command, _ in rows} == {m.__name__.rsplit(".")[-1] for m in COMMANDS}
    for node in [*STACK_CASES.values(), *OTHER_CASES.values()]:
        path, name = node.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), node


def test_every_exit_code_a_command_names_has_its_row() -> None:
    """A command whose module returns 1 or 75 has that row: `migrate` exits 75 when other
    sessions held the tables' locks longer than --wait, and the table had no such row (a cron
    wrapper read 75 as "the run key is locked"; adversary, issue 31)."""
    import importlib
    import inspect

    from airflow_idempotency.cli import COMMANDS

    rows = documented_rows()
    for module in COMMANDS:
        command = module.__name__.rsplit(".")[-1]
        source = inspect.getsource(importlib.import_module(module.__name__))
        for name, code in (("EXIT_FAILED", 1), ("EXIT_LOCKED", 75)):
            if name in source:
                assert (command, code) in rows, f"docs/cli.md has no row `{command}` {code}"


@pytest.mark.parametrize(("command", "code"), list(CASES), ids=[f"{c}-{n}" for c, n in CASES])
def test_exit_code_of_each_documented_row(
    command: str, code: int, pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command of the row exits with the row's code and says why (docs/cli.md)."""
    case = CASES[command, code]
    dsn = UNREACHABLE if case.unreachable else pg_dsn
    with case.setup(pg_dsn):
        capsys.readouterr()
        exit_code = main([*case.argv, "--dsn", dsn])
        out = capsys.readouterr()
    assert exit_code == code, out.out + out.err
    assert case.says in out.out + out.err
    assert "Traceback" not in out.err, out.err[:1500]
