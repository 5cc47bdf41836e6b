"""``python -m bench [NAME ...] [--size tiny|small|full] [--only NAME ...] [--output FILE]``.

Runs the benchmarks, prints one table of figures and side-by-side ratios, and writes
BENCHMARKS.md (by default only when every benchmark ran at ``--size full``, the size the
targets are stated for).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib
import shlex
import sys
import time
import traceback
from pathlib import Path

from bench.common import (
    SETTLE_SECONDS,
    SIZES,
    BenchResult,
    machine_info,
    say,
    settled_load_average,
)
from bench.report import merge_markdown, render_markdown, render_table
from devtools.postgres import find_server

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = (
    "overhead",
    "decision",
    "contention",
    "invoices",
    "export",
    "emails",
    "airflow_e2e",
    "partitions_e2e",
    "ui",
    "scale",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run, as --only (`python -m bench scale`); any of {BENCHMARKS}",
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument(
        "--only", nargs="+", choices=BENCHMARKS, metavar="NAME", help=f"any of {BENCHMARKS}"
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="write the report here (default: BENCHMARKS.md for a full run of every "
        "benchmark, none otherwise)",
    )
    parser.add_argument(
        "--airflow-rounds",
        type=int,
        metavar="N",
        help="timed passes per DAG and line of airflow_e2e (default: the size's; fewer "
        "when the machine is too loaded for the full run to finish in time)",
    )
    parser.add_argument(
        "--scale-runs",
        type=int,
        nargs="+",
        metavar="N",
        help="runs at once in each cell of the scale benchmark (default: the size's; full: "
        "100 500 1000)",
    )
    parser.add_argument(
        "--scale-processes",
        type=int,
        metavar="K",
        help="driver processes of each scale cell, its N runs spread over them as threads "
        "(default 4; 1: every run a thread of the benchmark's own process)",
    )
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace these benchmarks' rows and sections in BENCHMARKS.md (or --output), "
        "leaving every other benchmark's as it is, and say when and at what load they were "
        "re-measured",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}: any of {BENCHMARKS}")
    if args.names:
        args.only = [*(args.only or []), *args.names]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    size = SIZES[args.size]
    if args.airflow_rounds is not None:
        if args.airflow_rounds < 1:
            raise SystemExit("--airflow-rounds must be at least 1")
        size = dataclasses.replace(size, airflow_rounds=args.airflow_rounds)
    if args.scale_runs:
        if min(args.scale_runs) < 1:
            raise SystemExit("--scale-runs must be at least 1")
        size = dataclasses.replace(size, scale_runs=tuple(args.scale_runs))
    if args.scale_processes is not None:
        if args.scale_processes < 1:
            raise SystemExit("--scale-processes must be at least 1")
        size = dataclasses.replace(size, scale_processes=args.scale_processes)
    command = "python3 dev.py bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    server = find_server()
    started = dt.datetime.now(dt.timezone.utc)
    machine = machine_info(server)
    results: list[BenchResult] = []
    try:
        for name in args.only or BENCHMARKS:
            module = importlib.import_module(f"bench.{name}")
            say(f"{name} ({size.name}) ...")
            t0 = time.monotonic()
            try:
                result: BenchResult = module.run(size, server)
            except Exception as exc:  # report and go on: one broken benchmark is not all
                result = BenchResult(name, getattr(module, "TITLE", name))
                result.error = " ".join(f"{type(exc).__name__}: {exc}".split())
                say(f"{name} FAILED:\n{traceback.format_exc()}")
            result.seconds = time.monotonic() - t0
            say(f"{name} done in {result.seconds:.0f} s")
            results.append(result)
    finally:
        server.close()
    # Only a full-size run's figures count, so only it waits for the load to settle.
    machine["load average (end)"] = settled_load_average(
        timeout=SETTLE_SECONDS if size.name == "full" else 0
    )
    table = render_table(results)
    print(table)
    print(
        f"load average: {machine['load average']} at the start, {machine['load average (end)']} at the end"
    )
    # Only a complete run at the target size replaces BENCHMARKS.md by default.
    complete = size.name == "full" and not args.only
    output = args.output or (ROOT / "BENCHMARKS.md" if complete or args.merge else None)
    if output and not args.no_write:
        if args.merge:
            existing = output.read_text(encoding="utf-8")
            text = merge_markdown(existing, results, machine, command, started)
        else:
            text = render_markdown(results, size, machine, command, started)
        output.write_text(text, encoding="utf-8")
        say(f"wrote {output}")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
