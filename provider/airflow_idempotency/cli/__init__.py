"""``airflow-idempotency``: the on-call operator's view of runs, locks and the ledger.

Exit codes (the runbook's): 0 success, or an already completed key (a no-op);
1 failure, or something to look at (``gaps`` found periods without a completed run,
``runs --stale`` found abandoned work); 2 bad input (a malformed date, an unknown job or
DAG, a range that ends before it starts, a run key that would be refused), nothing
written; 75 the run key is locked elsewhere.

Read-only commands (``runs``, ``show``, ``locks``, ``ledger``) never write: they refuse a
database whose bookkeeping schema is missing or older than this version instead of
creating or migrating it; ``migrate`` does that on purpose.

The database comes from ``--dsn`` (or ``AIRFLOW_IDEMPOTENCY_DSN``), else from the Airflow
connection ``--conn-id`` (default ``idempotency_default``).

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
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    common_options,
)
from airflow_idempotency.exceptions import InvalidInputError
from airflow_idempotency.schema import validate_schema_name

RECORD_COMMANDS = (runs, show, locks, ledger, reset, migrate, gaps, prune)
DAG_COMMANDS = (run, explain, plan, adopt)
# In the order `--help` lists them.
COMMANDS = (runs, show, locks, ledger, reset, migrate, run, gaps, prune, explain, plan, adopt)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command, each added by its own module."""
    parser = argparse.ArgumentParser(
        prog="airflow-idempotency", description=(__doc__ or "").split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    common = common_options()
    for command in COMMANDS:
        command.register(commands, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code (bad usage exits 2 from argparse itself)."""
    args = build_parser().parse_args(argv)
    try:
        validate_schema_name(args.schema)
        return int(args.func(args))
    except InvalidInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CommandError as exc:
        print(f"error: {exc}" if exc.code != EXIT_OK else str(exc), file=sys.stderr)
        return exc.code
    except psycopg.OperationalError as exc:
        print(f"error: cannot reach the job database: {exc}", file=sys.stderr)
        return EXIT_FAILED


__all__ = ["COMMANDS", "DAG_COMMANDS", "RECORD_COMMANDS", "build_parser", "main"]
