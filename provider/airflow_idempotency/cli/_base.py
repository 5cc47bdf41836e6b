"""What every command shares: exit codes, the common options and how a command is added.

Nothing here imports Airflow.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

from airflow_idempotency.cli import _arguments
from airflow_idempotency.schema import DEFAULT_CONN_ID, DEFAULT_SCHEMA

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]

# The runbook's exit codes (docs/cli.md has them per command). 69 is sysexits.h's
# EX_UNAVAILABLE and 75 its EX_TEMPFAIL: neither collides with 1, which `ledger`, `gaps` and
# `runs --stale` use for "something to look at".
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_LOCKED = 0, 1, 2, 69, 75
DSN_ENV = "AIRFLOW_IDEMPOTENCY_DSN"

Handler = Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A command cannot go on: its message is printed, the process exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def common_options(*, defaults: bool) -> argparse.ArgumentParser:
    """The options every command takes (a parent parser), written before the command, after
    it or after a ``ledger`` action with the same meaning.

    The top-level parser takes them with their defaults (``defaults=True``); each command and
    action with ``argparse.SUPPRESS`` instead, so that it sets only what is written after it:
    argparse copies a subcommand's defaults over the values parsed before it, which would
    reset ``ledger --dsn B resend ...`` to the default database.
    """

    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("the job database and the output (anywhere on the line)")
    database: tuple[tuple[str, Callable[[str], object], object, str], ...] = (
        (
            "--dsn",
            _arguments.dsn,
            None,
            f"libpq connection string or URI of the job database, e.g. 'host=db dbname=jobs "
            f"user=airflow' (default: ${DSN_ENV}, else the Airflow connection --conn-id)",
        ),
        (
            "--conn-id",
            _arguments.text,
            DEFAULT_CONN_ID,
            f"Airflow connection of the job database when there is no DSN "
            f"(default: {DEFAULT_CONN_ID})",
        ),
        (
            "--schema",
            _arguments.schema_name,
            DEFAULT_SCHEMA,
            f"the bookkeeping schema (default: {DEFAULT_SCHEMA})",
        ),
    )
    for flag, kind, value, text in database:
        group.add_argument(flag, type=kind, default=default(value), help=text)
    group.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help="print JSON for scripts (times in ISO 8601), nothing else on stdout",
    )
    return common


def add_command(
    commands: Subcommands,
    common: argparse.ArgumentParser,
    name: str,
    help: str,
    handler: Handler,
    examples: str = "",
) -> argparse.ArgumentParser:
    """Add the command ``name`` run by ``handler`` (whose docstring describes it), with the
    ``examples`` (one per line) under its help; its module then adds the command's own options
    to the parser returned."""
    parser = commands.add_parser(
        name,
        parents=[common],
        help=help,
        description=inspect.cleandoc(handler.__doc__ or help),
        epilog=epilog(examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=handler)
    return parser


def add_range(
    parser: argparse.ArgumentParser,
    kind: str,
    convert: Callable[[str], object],
    metavar: str,
    first: str,
    last: str,
) -> None:
    """A command's required ``--from`` and ``--to`` (into ``from_KIND`` and ``to_KIND``),
    each value read by ``convert``; ``first`` and ``last`` are their help."""
    for flag, text in (("--from", first), ("--to", last)):
        parser.add_argument(
            flag,
            dest=f"{flag[2:]}_{kind}",
            type=convert,
            required=True,
            metavar=metavar,
            help=text,
        )


def epilog(examples: str) -> str | None:
    """The examples of a command's help, each line after the program's name."""
    lines = [line.strip() for line in examples.strip().splitlines() if line.strip()]
    if not lines:
        return None
    return "examples:\n" + "\n".join(f"  airflow-idempotency {line}" for line in lines)
