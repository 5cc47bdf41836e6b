"""The command line of chaos: ``python3 dev.py chaos [--seed N] [--steps N] [--builds ...]``.

``--builds correct,fence-off:lease`` names each phase's build and, after a colon, its lock
mode (``--lock-mode`` where none is named: ``advisory`` by default).

Parses and checks the options (every phase's business dates must have ended, before anything
starts), runs :class:`~devtools.chaos.run.Chaos`, prints and writes the summary (JSON, and the
chaos section of FAULTS.md with ``--faults-md``). ``--seed N`` replays the same sequence of
actions and faults (their timing, and so the interleaving, depends on the machine). Exits 0
when every phase ended as it must (correct: no violation; broken: caught), else 1.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devtools.airflow_env import ROOT
from devtools.chaos.builds import BROKEN, BUILDS, CORRECT, LOCK_MODES, split_phase
from devtools.chaos.faults import PROOFS
from devtools.chaos.phases import phase_dates, say
from devtools.chaos.report import render_markdown, write_faults_md
from devtools.chaos.run import Chaos

DESCRIPTION = (
    "Chaos: seeded, overlapping actions and faults against the real stack, checked against "
    "invariants."
)


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{what}: {', '.join(unknown) or 'none given'}; choose from {', '.join(known)}"
        )
    return names


def _phases(text: str) -> list[str]:
    """``--builds``: comma-separated ``NAME`` or ``NAME:MODE``, each checked."""
    phases = [p.strip() for p in text.split(",") if p.strip()]
    if not phases:
        raise argparse.ArgumentTypeError("--builds: none given")
    for phase in phases:
        try:
            split_phase(phase, LOCK_MODES[0])
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--builds: {exc}") from exc
    return phases


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 dev.py chaos", description=DESCRIPTION)
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed (printed)")
    parser.add_argument("--steps", type=int, default=60, help="steps of a correct phase")
    parser.add_argument(
        "--minutes", type=float, default=30.0, help="stop drawing steps after this (a phase)"
    )
    parser.add_argument(
        "--dates", type=int, default=4, help="business dates in play at once, from 2026-10-01"
    )
    parser.add_argument(
        "--new-date-every",
        type=int,
        default=10,
        help="steps after which the window of dates moves on by one date (0: never)",
    )
    parser.add_argument("--orders", type=int, default=30, help="orders per business date")
    parser.add_argument("--overlap", type=int, default=3, help="actions in flight at most")
    parser.add_argument("--max-gap", type=float, default=4.0, help="seconds between steps, at most")
    parser.add_argument(
        "--check-every", type=int, default=10, help="steps between quiescent checks"
    )
    parser.add_argument("--fault-rate", type=float, default=0.6, help="chance of a fault per step")
    parser.add_argument("--action-timeout", type=float, default=420.0)
    parser.add_argument(
        "--parallelism", type=int, default=4, help="task instances Airflow runs at once"
    )
    builds = tuple(BUILDS)
    parser.add_argument(
        "--builds",
        type=_phases,
        default=[CORRECT],
        help="the builds to run, one phase each on one stack, comma-separated: "
        + ", ".join(builds)
        + "; NAME:MODE runs that phase in lock mode MODE (correct:lease)",
    )
    parser.add_argument(
        "--lock-mode",
        choices=LOCK_MODES,
        default=LOCK_MODES[0],
        help="the lock mode of every phase whose --builds entry names none (the job "
        "database's Airflow connection's extra lock_mode; docs/locks.md)",
    )
    parser.add_argument(
        "--broken",
        choices=BROKEN,
        default=None,
        help="run only this deliberately broken copy of the provider (= --builds NAME)",
    )
    parser.add_argument(
        "--broken-steps",
        type=int,
        default=25,
        help="steps a broken build's phase may take to be caught",
    )
    parser.add_argument(
        "--broken-seed",
        type=int,
        default=None,
        help="the seed of every broken build's phase (default: each build's own, "
        "devtools/chaos/builds.py)",
    )
    parser.add_argument(
        "--require-fired",
        type=lambda text: _names(text, tuple(PROOFS), "--require-fired"),
        default=[],
        help="faults a correct phase must have seen happen (forced at its end if not): "
        + ", ".join(PROOFS),
    )
    parser.add_argument(
        "--airflow-db",
        choices=("postgres", "sqlite"),
        default="postgres",
        help="Airflow's metadata database: a temporary database on the PostgreSQL server "
        "the tests use (default), or SQLite in the work folder",
    )
    parser.add_argument("--workdir", type=Path, default=ROOT / ".chaos")
    parser.add_argument("--summary", type=Path, default=None, help="write the summary JSON here")
    parser.add_argument(
        "--faults-md", type=Path, default=None, help="write the summary into this FAULTS.md"
    )
    parser.add_argument(
        "--from-summary",
        type=Path,
        default=None,
        help="with --faults-md: render a summary JSON written earlier instead of running",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.broken:
        args.builds = [args.broken]
    if args.steps < 1 or args.dates < 1 or args.orders < 1 or args.overlap < 1:
        parser().error("--steps, --dates, --orders and --overlap must be at least 1")
    if args.new_date_every < 0 or args.check_every < 1 or args.broken_steps < 1:
        parser().error("--new-date-every must not be negative, --check-every at least 1")
    if args.from_summary:
        if not args.faults_md:
            parser().error("--from-summary needs --faults-md")
        saved = json.loads(args.from_summary.read_text(encoding="utf-8"))
        write_faults_md(args.faults_md, render_markdown(saved, saved.get("command", "")))
        return 0
    try:
        phase_dates(args)  # every phase's dates exist, before a stack starts
    except ValueError as exc:
        parser().error(str(exc))
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 10**6)
    # SIGTERM (a CI timeout, a test's clean-up) unwinds like Ctrl-C: the stack, the service
    # and the private server are stopped by the finally blocks, none is left behind.
    signal.signal(signal.SIGTERM, _terminate)
    chaos = Chaos(args)
    error = ""
    try:
        chaos.run()
    except Exception as exc:  # the set-up failed: reported, the summary says so
        error = f"{type(exc).__name__}: {exc}"
        say(f"chaos could not run: {error}")
    phases = [
        p.summary or {"build": p.build.name, "lock_mode": p.lock_mode, "ok": False}
        for p in chaos.phases
    ]
    summary = {
        "seed": args.seed,
        "startup_seconds": round(chaos.startup_seconds, 1),
        "phases": phases,
        "error": error,
        "command": "python3 dev.py chaos " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print("chaos summary: " + json.dumps(summary, default=str), flush=True)
    for phase in phases:
        verdict = "as expected" if phase.get("ok") else "NOT AS EXPECTED"
        say(
            f"build {phase.get('build')} ({phase.get('lock_mode')} mode): {verdict} "
            f"({phase.get('steps')} steps, "
            f"{phase.get('seconds')} s, violations: {phase.get('violations') or 'none'})"
        )
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    if args.faults_md:
        write_faults_md(args.faults_md, render_markdown(summary, summary["command"]))
    complete = len(phases) == len(args.builds) and not error
    return 0 if complete and all(p.get("ok") for p in phases) else 1
