"""The chaos section of FAULTS.md, from the summary JSON of a chaos run (devtools/chaos/)."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from pathlib import Path
from typing import Any

from devtools.chaos.builds import BUILDS, CORRECT

CHAOS_BEGIN = "<!-- chaos:begin -->"
CHAOS_END = "<!-- chaos:end -->"


def _counts(data: Any) -> str:
    return ", ".join(f"{k} {v}" for k, v in dict(data or {}).items()) or "none"


def render_phase(phase: dict[str, Any]) -> list[str]:
    """The lines of one correct phase (a long run) in FAULTS.md."""
    dates = list(phase.get("dates") or [])
    violations = phase.get("violations") or []
    return [
        f"- Build `{phase.get('build', CORRECT)}`, lock mode "
        f"{phase.get('lock_mode', 'advisory')}: seed **{phase.get('seed')}**; "
        f"**{phase.get('steps')} steps** after start-up in {phase.get('seconds')} s; "
        f"{len(dates)} business dates touched"
        + (f" ({dates[0]} .. {dates[-1]})" if dates else "")
        + f", {phase.get('orders_per_date')} orders each",
        f"- Actions by kind: {_counts(phase.get('actions'))}",
        f"- Faults by kind: {_counts(phase.get('faults'))}",
        f"- Fault outcomes: {_counts(phase.get('fault_results'))}",
        f"- Faults that fired: {_counts(phase.get('fired'))}; crash points claimed (a worker "
        f"SIGKILLed there): {_counts(Counter(phase.get('crashes_claimed') or []))}",
        f"- Attempts by outcome: {_counts(phase.get('attempt_outcomes'))}; the lock mode "
        f"checked: {phase.get('lock_mode_used', '-')}",
        f"- Witnesses: {_counts(phase.get('witness'))}; requests at the remote by outcome: "
        f"{_counts(phase.get('remote'))}",
        f"- Quiescent points: {phase.get('quiescent_points')}; Airflow components restarted "
        f"after they died: {_counts(phase.get('components_restarted'))}",
        f"- Result: **{len(violations)} violation(s)**"
        + (f": {', '.join(violations)}" if violations else ""),
        "",
        "| invariant | times checked |",
        "|---|---:|",
        *(f"| {name} | {n} |" for name, n in dict(phase.get("invariant_checks") or {}).items()),
        "",
    ]


def render_markdown(summary: dict[str, Any], command: str) -> str:
    """The chaos section of FAULTS.md for one run's summary."""
    phases = list(summary.get("phases") or [])
    correct = [p for p in phases if not p.get("broken")]
    broken = [p for p in phases if p.get("broken")]
    lines = [
        CHAOS_BEGIN,
        "## Chaos (devtools/chaos/)",
        "",
        "Seeded, overlapping actions and independent faults against the real Airflow 3 stack, "
        "a private PostgreSQL and the accounting service. The history invariants (executions "
        "counted by the witnesses: work_witness, the remote's request log, the lock sessions "
        "chaos ended) are checked after every step, the end state at every quiescent point and "
        "after a final convergence pass (docs/chaos.md). Written by `python3 dev.py chaos "
        "--faults-md FAULTS.md` (kept when `python3 dev.py faults` rewrites the rest of this "
        "file).",
        "",
        f"- Command: `{command}`",
        f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; seed "
        f"{summary.get('seed')}; stack start-up {summary.get('startup_seconds')} s",
    ]
    for phase in correct:
        lines += render_phase(phase)
    if broken:
        lines += [
            "Broken builds (devtools/chaos/builds.py), each a patched copy of the provider run "
            "on the same stack, each to be caught:",
            "",
            "| build | lock mode | what is broken | seed | caught at step | seconds to catch "
            "| phase seconds | caught by |",
            "|---|---|---|---:|---:|---:|---:|---|",
        ]
        for phase in broken:
            build = BUILDS.get(str(phase.get("build")))
            lines.append(
                f"| `{phase.get('build')}` | {phase.get('lock_mode', 'advisory')} "
                f"| {build.what if build else ''} | {phase.get('seed')} "
                f"| {phase.get('caught_at_step') or 'NOT CAUGHT'} "
                f"| {phase.get('caught_after_seconds') or '-'} | {phase.get('seconds')} "
                f"| {'; '.join(phase.get('violations') or []) or '-'} |"
            )
        lines.append("")
    lines.append(CHAOS_END)
    return "\n".join(lines)


def write_faults_md(path: Path, section: str) -> None:
    """Replace (or append) the chaos section of ``path``."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if CHAOS_BEGIN in text and CHAOS_END in text:
        head, rest = text.split(CHAOS_BEGIN, 1)
        tail = rest.split(CHAOS_END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text, encoding="utf-8")
