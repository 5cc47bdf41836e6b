"""Command line: ``python -m accounting_service --dsn DSN`` or ``accounting-service``.

Every option can also come from an environment variable ``ACCOUNTING_<OPTION>``
(``--fail-rate`` from ``ACCOUNTING_FAIL_RATE``, ``--dsn`` from ``ACCOUNTING_DSN``);
the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from accounting_service.faults import ENV_PREFIX, FIELD_TYPES, RESET_PHASES, FaultSettings
from accounting_service.server import serve
from accounting_service.settings import ServiceSettings

_FAULT_HELP = {
    "fail_rate": "share of POSTs answered 503 before anything is done",
    "timeout_after_commit_rate": "share of POSTs that commit, then hang --hang-seconds",
    "reset_rate": "share of POSTs whose connection is reset without a response",
    "reset_phase": "whether the reset comes before or after the invoice is committed",
    "latency_ms": "latency added to every POST, in milliseconds",
    "hang_seconds": "how long a timeout_after_commit POST hangs before answering",
    "seed": "seed of the generator that decides which POSTs get a fault",
}


def _env(name: str, default: object = None) -> object:
    return os.environ.get(ENV_PREFIX + name.upper(), default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accounting-service",
        description="Example accounting HTTP service with idempotent invoice creation.",
        epilog=f"Every option can also be set as {ENV_PREFIX}<OPTION>, e.g. "
        f"{ENV_PREFIX}FAIL_RATE=0.1; the command line wins.",
    )
    # String defaults go through `type`, so environment values are parsed like flags.
    parser.add_argument("--dsn", default=_env("dsn"), help="libpq DSN of the database")
    parser.add_argument("--host", default=_env("host", "127.0.0.1"), help="default 127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=_env("port", "8099"), help="default 8099; 0 picks a free one"
    )
    parser.add_argument(
        "--workers", type=int, default=_env("workers", "1"), help="processes (default 1)"
    )
    parser.add_argument(
        "--pool-size",
        type=int,
        default=_env("pool_size", "10"),
        help="database connections per worker (default 10)",
    )
    parser.add_argument(
        "--log-level",
        default=_env("log_level", "warning"),
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="default warning; access logs are always off",
    )
    faults = parser.add_argument_group("fault injection (also PUT /admin/faults at run time)")
    defaults = FaultSettings().as_dict()
    for name, kind in FIELD_TYPES.items():
        faults.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=_env(name, str(defaults[name])),
            choices=RESET_PHASES if name == "reset_phase" else None,
            help=f"{_FAULT_HELP[name]} (default {defaults[name]})",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error(f"a database is needed: --dsn or {ENV_PREFIX}DSN")
    if args.workers < 1 or args.pool_size < 1:
        parser.error("--workers and --pool-size must be at least 1")
    try:
        faults = FaultSettings(**{name: getattr(args, name) for name in FIELD_TYPES})
    except ValueError as exc:
        parser.error(str(exc))
    settings = ServiceSettings(dsn=args.dsn, pool_size=args.pool_size, faults=faults)
    return serve(
        settings,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level=args.log_level,
    )


if __name__ == "__main__":
    sys.exit(main())
