"""``airflow-idempotency``: the on-call operator's view of runs, locks and the ledger.

Exit codes (the runbook's; docs/cli.md has them per command): 0 success, or an already
completed key (a no-op); 1 failure, or something to look at (``ledger`` found an unknown
effect, ``gaps`` periods without a completed run, ``runs --stale`` abandoned work); 2 bad
input (an option's value, an unknown job or DAG, a range that ends before it starts, a run
key that would be refused), nothing written; 69 the job database cannot serve the command
(unreachable, no bookkeeping tables, missing privileges); 75 the run key is locked
elsewhere (``migrate``: other sessions hold the tables' locks), try again later.

The commands but ``migrate`` and ``reset`` never create or migrate the bookkeeping schema:
they refuse a database whose schema is missing or older than this version; ``migrate``
does that on purpose.

The database comes from ``--dsn`` (or ``AIRFLOW_IDEMPOTENCY_DSN``), else from the Airflow
connection ``--conn-id`` (default ``idempotency_default``). The common options mean the
same anywhere on the line (``_base.common_options``).

One module per command, each declaring its options beside its handler (``register`` and
``handle``); this module only assembles them. The commands of :data:`RECORD_COMMANDS` read
and write the job database alone and import Airflow only to read ``--conn-id``; those of
:data:`DAG_COMMANDS` parse a DAG, through Airflow (``_dags.py``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import psycopg

from airflow_idempotency.cli import (
    adopt,
    explain,
    gaps,
    ledger,
    locks,
    migrate,
    plan,
    prune,
    reset,
    run,
    runs,
    show,
)
from airflow_idempotency.cli._base import (
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CommandError,
    common_options,
)
from airflow_idempotency.exceptions import ConfigurationError, InvalidInputError
from airflow_idempotency.provider_info import __version__

RECORD_COMMANDS = (runs, show, locks, ledger, reset, migrate, gaps, prune)
DAG_COMMANDS = (run, explain, plan, adopt)
# In the order `--help` lists them.
COMMANDS = (runs, show, locks, ledger, reset, migrate, run, gaps, prune, explain, plan, adopt)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command, each added by its own module. The common options are
    the top-level parser's, with their defaults, and every command's, without (see
    :func:`~airflow_idempotency.cli._base.common_options`)."""
    parser = argparse.ArgumentParser(
        prog="airflow-idempotency",
        description=(__doc__ or "").split("\n\n")[0],
        parents=[common_options(defaults=True)],
        epilog="`airflow-idempotency COMMAND --help` shows a command's options and examples; "
        "docs/cli.md has the exit codes of each command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = common_options(defaults=False)
    for command in COMMANDS:
        command.register(commands, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code (2 for bad usage, after argparse printed why)."""
    parser = build_parser()
    try:
        for arg in sys.argv[1:] if argv is None else argv:
            if arg.startswith("--") and arg.endswith("=--"):
                # Python 3.11's argparse drops a value "--" without a word (found by Hypothesis).
                parser.error(f"argument {arg[:-3]}: '--' is not a value this option takes")
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse's: bad usage (2), or --help / --version (0)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return int(args.func(args))
    except InvalidInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CommandError as exc:
        print(f"error: {exc}" if exc.code != EXIT_OK else str(exc), file=sys.stderr)
        return exc.code
    except ConfigurationError as exc:  # e.g. a role without the privileges `migrate` needs
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except psycopg.OperationalError as exc:  # the connection broke during the command
        print(f"error: lost the job database: {str(exc).strip()}", file=sys.stderr)
        return EXIT_UNAVAILABLE


__all__ = ["COMMANDS", "DAG_COMMANDS", "RECORD_COMMANDS", "build_parser", "main"]
