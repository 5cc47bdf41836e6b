"""The CLI's command lines, property-based (no database): an option means the same wherever it
is written (before the command, after it, after a ``ledger`` action, between positionals), and
every value is either taken as written or refused with exit 2 by a message that names its
option, never a traceback. Deterministic examples (``derandomize``: the same on every run)."""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import unicodedata
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_idempotency.cli import COMMANDS, build_parser, main

PROPERTY = settings(
    max_examples=300,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# What every command takes, anywhere on the line: each a group of tokens.
COMMON = (
    ("--dsn", "host=db dbname=b"),
    ("--conn-id", "jobs_b"),
    ("--schema", "idem_b"),
    ("--json",),
)
# Nothing listens there: a command that parsed fails to connect, quickly (exit 69).
UNREACHABLE = "host=127.0.0.1 port=1 connect_timeout=2"


@dataclass(frozen=True)
class Line:
    """A command line in parts: the command (and a ledger action), its positionals in order,
    its own options (token groups, in any order among the positionals)."""

    command: tuple[str, ...]
    positionals: tuple[str, ...] = ()
    options: tuple[tuple[str, ...], ...] = ()


LINES = (
    Line(("runs",), (), (("--job", "j"), ("--status", "failed"), ("--from", "2026-10-01"),
                         ("--to", "2026-10-31"), ("--limit", "5"))),
    Line(("show",), ("j", "2026-10-01")),
    Line(("locks",)),
    Line(("ledger",), (), (("--job", "j"), ("--run-key", "2026-10-01"), ("--all",),
                           ("--limit", "7"))),
    Line(("ledger", "resend"), ("finance_mail", "mail:1"), (("--reason", "checked"),
                                                            ("--by", "ann"))),
    Line(("ledger", "mark-sent"), ("finance_mail", "mail:1"), (("--reason", "found it"),)),
    Line(("reset",), ("j", "2026-10-01"), (("--reason", "stuck"),)),
    Line(("migrate",)),
    Line(("run",), ("dag",), (("--date", "2026-10-01"), ("--force",), ("--dry-run",),
                              ("--dags-folder", "/dags"))),
    Line(("gaps",), ("j",), (("--from", "2026-10-01"), ("--to", "2026-10-31"),
                             ("--segment", "eu"), ("--dag", "d"))),
    Line(("prune",), (), (("--attempts-older-than", "400d"), ("--dry-run",),
                          ("--batch-size", "10"))),
    Line(("explain",), ("dag",), (("--logical-date", "2026-10-02"), ("--run-type", "manual"),
                                  ("--conf", '{"run_key": "2026-10-01"}'))),
    Line(("plan",), ("dag",), (("--from", "2026-10-01"), ("--to", "2026-10-03"),
                               ("--command", "dags-backfill"))),
)  # fmt: skip


def parsed(argv: list[str]) -> dict[str, object]:
    return vars(build_parser().parse_args(argv))


def canonical(line: Line, common: list[tuple[str, ...]]) -> list[str]:
    """The line as the reference writes it: command, positionals, its options, then the
    common ones."""
    own = [token for group in line.options for token in group]
    return [*line.command, *line.positionals, *own, *(t for g in common for t in g)]


@st.composite
def shuffled(draw: st.DrawFn, line: Line) -> tuple[list[str], list[tuple[str, ...]]]:
    """The line with its options in a random order among its positionals, and a random subset
    of the common options each written before the command, after it or (for a ledger
    action) between ``ledger`` and the action."""
    common = draw(st.lists(st.sampled_from(COMMON), unique=True))
    before: list[str] = []
    between: list[str] = []  # ledger ... ACTION
    groups: list[tuple[str, ...]] = list(draw(st.permutations(line.options)))
    for group in common:
        place = draw(st.sampled_from(["before", "after", "between"]))
        if place == "before":
            before += group
        elif place == "between" and len(line.command) == 2:
            between += group
        else:
            groups.insert(draw(st.integers(0, len(groups))), group)
    # The positionals, in their order, each at a random place among the option groups.
    places = sorted(
        draw(st.lists(st.integers(0, len(groups)), min_size=len(line.positionals),
                      max_size=len(line.positionals)))
    )  # fmt: skip
    tail: list[tuple[str, ...]] = []
    for index in range(len(groups) + 1):
        tail += [(p,) for p, place in zip(line.positionals, places, strict=True) if place == index]
        tail += groups[index : index + 1]
    rest = [token for group in tail for token in group]
    argv = [*before, line.command[0], *between, *line.command[1:], *rest]
    return argv, common


@pytest.mark.parametrize("line", LINES, ids=[" ".join(line.command) for line in LINES])
@PROPERTY
@given(data=st.data())
def test_options_mean_the_same_in_any_order_and_at_any_level(
    line: Line, data: st.DataObject
) -> None:
    """Any order of a command's options among its positionals, and the common options before
    the command, after it or after a ledger action, parse to what the canonical line does:
    nothing written before a command (or an action) is reset to its default."""
    argv, common = data.draw(shuffled(line))
    assert parsed(argv) == parsed(canonical(line, common)), argv


def test_an_option_written_before_the_ledger_action_is_kept() -> None:
    """The reported case: `ledger --dsn B resend ...` keeps B (it was reset to the default,
    so the resend went to the database of AIRFLOW_IDEMPOTENCY_DSN)."""
    args = parsed(["ledger", "--dsn", "host=b", "--json", "resend", "r", "k", "--reason", "x"])
    assert (args["dsn"], args["json"], args["ledger_action"]) == ("host=b", True, "resend")


def is_storable(value: str) -> bool:
    """What the CLI's text options take: not blank, no control or surrogate character."""
    return (
        bool(value.strip())
        and len(value) <= 1000
        and not any(unicodedata.category(c) in ("Cc", "Cs") for c in value)
    )


def run_main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


TEXT_OPTIONS = [
    (["runs"], "--job"),
    (["runs"], "--from"),
    (["ledger"], "--run-key"),
    (["ledger", "resend", "r", "k"], "--reason"),
    (["reset", "j", "k"], "--reason"),
    (["gaps", "j", "--from", "2026-10-01", "--to", "2026-10-02"], "--segment"),
    (["runs"], "--conn-id"),
]


@pytest.mark.parametrize(("before", "option"), TEXT_OPTIONS, ids=[o for _, o in TEXT_OPTIONS])
@PROPERTY
@given(value=st.text(max_size=40) | st.sampled_from(["a\x00b", "\udcff", " ", "x" * 1001]))
def test_odd_text_is_taken_as_written_or_refused_naming_the_option(
    before: list[str], option: str, value: str
) -> None:
    """Any text for a text option (NUL bytes, undecodable bytes, newlines, blanks, very long)
    is taken exactly as written, or refused with exit 2 and a message naming the option."""
    argv = [*before, f"{option}={value}"]
    if is_storable(value) and value != "--":  # "--": refused by main (argparse drops it)
        args = build_parser().parse_args(argv)
        dest = {"--from": "from_key", "--run-key": "run_key"}.get(option, option[2:])
        assert getattr(args, dest.replace("-", "_")) == value
        return
    code, err = run_main([*argv, "--dsn", UNREACHABLE])
    assert code == 2 and f"argument {option}:" in err, err


NUMBER_OPTIONS = [
    (["runs"], "--limit", 100_000),
    (["ledger"], "--limit", 100_000),
    (["prune", "--attempts-older-than", "400d"], "--batch-size", 1_000_000),
]


@pytest.mark.parametrize(
    ("before", "option", "maximum"), NUMBER_OPTIONS, ids=[" ".join(b) for b, _, _ in NUMBER_OPTIONS]
)
@PROPERTY
@given(
    value=st.integers(-(10**30), 10**30).map(str)
    | st.text(max_size=12)
    | st.sampled_from(["-1", "0", "1_000", "\u0665", "1e3", " 5", "5 ", "+5", "0x10"])
)
def test_odd_numbers_are_in_range_or_refused_naming_the_option(
    before: list[str], option: str, maximum: int, value: str
) -> None:
    """A count is whole, written with ASCII digits, from 1 to its maximum; anything else
    (negative, zero, huge, 1_000, Arabic-Indic digits, blanks, text) exits 2 naming it."""
    argv = [*before, f"{option}={value}"]
    if value.isascii() and value.isdigit() and 1 <= int(value) <= maximum:
        dest = option[2:].replace("-", "_")
        assert getattr(build_parser().parse_args(argv), dest) == int(value)
        return
    code, err = run_main([*argv, "--dsn", UNREACHABLE])
    assert code == 2 and f"argument {option}:" in err, err


@PROPERTY
@given(days=st.integers(-(10**40), 10**40) | st.integers(0, 40_000), unit=st.sampled_from("dyh"))
def test_a_prune_age_is_whole_days_from_1_to_36500_or_refused(days: int, unit: str) -> None:
    """`prune --attempts-older-than`: 1d to 36500d is taken; 0, negative, huge ages and other
    units exit 2 naming the option (a huge age was an OverflowError and exit 1)."""
    value = f"{days}{unit}"
    argv = ["prune", f"--attempts-older-than={value}"]
    if unit == "d" and 1 <= days <= 36_500:
        assert build_parser().parse_args(argv).older_than.days == days
        return
    code, err = run_main([*argv, "--dsn", UNREACHABLE])
    assert code == 2 and "argument --attempts-older-than:" in err, err


@pytest.mark.parametrize(
    "password", ["two words", "it's", 'say "hi"', "back\\slash", "=;' \\'"], ids=repr
)
def test_a_refused_dsn_is_never_quoted_back(password: str) -> None:
    """A --dsn libpq cannot read is refused with exit 2 and an example, without repeating
    any part of it (it may hold a password); the same password, quoted by psycopg, parses."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    code, err = run_main(["runs", "--dsn", f"host=db password={password} x"])
    assert code == 2 and "argument --dsn:" in err and "host=db dbname=jobs" in err
    assert password not in err
    quoted = make_conninfo("", host="db", password=password)
    assert conninfo_to_dict(parsed(["runs", "--dsn", quoted])["dsn"])["password"] == password  # type: ignore[arg-type]


def test_every_option_of_every_command_has_help_and_every_command_examples() -> None:
    """`--help` explains every option and positional of every command and ledger action, and
    each command shows examples that its own parser accepts."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parsers = dict(commands.choices)
    ledger_actions = next(
        a for a in parsers["ledger"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    parsers.update({f"ledger {n}": p for n, p in ledger_actions.choices.items()})
    assert set(commands.choices) == {m.__name__.rsplit(".")[-1] for m in COMMANDS}
    for name, command in parsers.items():
        for action in command._actions:
            assert action.help, f"{name}: {action.dest} has no help"
        assert command.epilog and "examples:" in command.epilog, name
        for example in command.epilog.splitlines()[1:]:
            argv = shlex.split(example.split("  # ")[0], posix=True)[1:]
            argv = [a.replace("$DSN", "host=db") for a in argv]
            build_parser().parse_args(argv)  # exits 2 (a failed test) when refused


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`--version` prints the provider's version and exits 0."""
    from airflow_idempotency import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"airflow-idempotency {__version__}"
