"""Chaos (devtools/chaos/) in CI: a short run in each lock mode that proves its faults fired,
and the broken builds it must catch, all on one Airflow stack (one chaos command, one phase
per build and lock mode).

The short run's seed changes every time and is printed; ``CHAOS_SEED=N`` replays it (the same
actions and faults; their interleaving depends on the machine's timing). The broken builds
(devtools/chaos/builds.py) run with their own fixed seeds and the exposure that shows their
bug at once, so that each is caught every time. They are split between the lock modes to keep
CI short (tests/faults/test_chaos_builds.py catches each one in both modes, without Airflow):
``lock-off`` and ``fence-off`` in the lease mode, whose lock and fence they break there too,
the others in the advisory mode.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devtools.chaos.builds import BUILDS, CORRECT
from support import ROOT

pytestmark = pytest.mark.airflow_processes

SHORT_STEPS = 20  # per lock mode (30 when only the advisory mode ran: CI time)
MODES = ("advisory", "lease")
CI_BROKEN = (
    ("lock-off", "lease"),
    ("fence-off", "lease"),
    ("completed-check-off", "advisory"),
    ("skip-confirmed", "advisory"),
)
CI_PHASES = (
    *((CORRECT, mode) for mode in MODES),
    *CI_BROKEN,
)
REQUIRED_FAULTS = ("crash", "terminate_lock", "restart")


@dataclass
class ChaosRun:
    seed: int
    code: int
    output: str
    summary: dict[str, Any]

    def phase(self, build: str, mode: str) -> dict[str, Any]:
        for phase in self.summary.get("phases", []):
            if phase.get("build") == build and phase.get("lock_mode") == mode:
                return dict(phase)
        raise AssertionError(
            f"no phase of build {build} in the {mode} mode (seed {self.seed}):\n{self.tail()}"
        )

    def tail(self) -> str:
        return self.output[-6000:]


def run_chaos(workdir: Path, *args: str, timeout: float) -> tuple[int, str, dict[str, Any]]:
    summary = workdir / "summary.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "dags"), env.get("PYTHONPATH")) if p
    )
    log = workdir / "chaos.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "devtools.chaos", *args, "--workdir", str(workdir / "chaos"),
             "--summary", str(summary)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=timeout)
        except BaseException:
            # SIGTERM: the runner stops its stack, service and server; SIGKILL would leak them.
            proc.terminate()
            proc.wait(timeout=120)
            raise
        finally:
            print(log.read_text(errors="replace")[-30000:])
    data = json.loads(summary.read_text()) if summary.exists() else {}
    return proc.returncode, log.read_text(errors="replace"), data


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> ChaosRun:
    """One chaos command: the short run of this checkout's provider in each lock mode, then each
    broken build in its mode, on one stack."""
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(1, 10**6))
    print(f"chaos seed {seed} (replay: CHAOS_SEED={seed})")
    code, out, summary = run_chaos(
        tmp_path_factory.mktemp("chaos"),
        "--seed", str(seed),
        "--builds", ",".join(f"{build}:{mode}" for build, mode in CI_PHASES),
        "--steps", str(SHORT_STEPS),
        "--check-every", "10",
        "--dates", "3",
        "--require-fired", ",".join(REQUIRED_FAULTS),
        timeout=1500,
    )  # fmt: skip
    return ChaosRun(seed, code, out, summary)


# Whichever test comes first runs the module's chaos command in its set-up: each may wait
# that long (the command's own limit is 1500 s; it takes 4-6 minutes).
CHAOS_TIMEOUT = pytest.mark.timeout(1800)


@pytest.mark.slow
@CHAOS_TIMEOUT
@pytest.mark.parametrize("mode", MODES)
def test_short_run_keeps_every_invariant_and_its_faults_fired(chaos: ChaosRun, mode: str) -> None:
    """The short run of this checkout's provider in lock mode ``mode`` (its runs held their
    keys so): every step after start-up was done, a crash point was claimed, a lock lost (a
    lock session ended; a lease taken over) and a server restarted, and every invariant held
    at every step, every quiescent point and after convergence."""
    phase = chaos.phase(CORRECT, mode)
    replay = f"CHAOS_SEED={chaos.seed} replays it"
    assert phase["violations"] == [], f"{phase['violations']} ({replay})\n{chaos.tail()}"
    assert phase["ok"], f"the short run did not converge ({replay})\n{chaos.tail()}"
    assert phase["steps"] >= SHORT_STEPS, phase
    lost = "leases taken over" if mode == "lease" else "lock sessions ended"
    assert phase["witness"][lost] >= 1, phase["witness"]  # the lock lost as the mode loses it
    fired = phase["fired"]
    assert all(fired[kind] >= 1 for kind in REQUIRED_FAULTS), f"faults fired: {fired}"
    checks = phase["invariant_checks"]
    assert checks["converged: every job of every touched date completed"] == 1
    assert checks["no commit after the lock was lost"] >= SHORT_STEPS
    print(
        f"short run ({mode}): {phase['steps']} steps in {phase['seconds']} s after a start-up "
        f"of {chaos.summary['startup_seconds']} s; faults fired {fired}; the lock mode: "
        f"{phase['lock_mode_used']}"
    )


@pytest.mark.slow
@CHAOS_TIMEOUT
@pytest.mark.parametrize(("build", "mode"), CI_BROKEN)
def test_broken_build_is_caught(chaos: ChaosRun, build: str, mode: str) -> None:
    """A patched copy of the provider with one guarantee removed is caught, in lock mode
    ``mode`` (its runs held their keys so), by an invariant that counts what happened, within
    its phase's steps."""
    phase = chaos.phase(build, mode)
    expected = set(BUILDS[build].caught_by)
    assert phase["caught_at_step"] is not None, f"{build} was not caught\n{chaos.tail()}"
    assert expected & set(phase["violations"]), (phase["violations"], expected)
    assert phase["ok"]
    print(
        f"{build} ({mode}): caught at step {phase['caught_at_step']} after "
        f"{phase['caught_after_seconds']} s ({phase['seconds']} s for the whole phase) by "
        f"{phase['violations']}"
    )


@pytest.mark.slow
@CHAOS_TIMEOUT
def test_chaos_exits_0_only_when_every_phase_went_as_it_must(chaos: ChaosRun) -> None:
    """The command's exit status says whether every phase went as it must."""
    ok = [phase.get("ok") for phase in chaos.summary.get("phases", [])]
    assert (chaos.code == 0) == (len(ok) == len(CI_PHASES) and all(ok)), chaos.tail()


def test_faults_md_section_is_replaced_and_kept_by_the_fault_report(tmp_path: Path) -> None:
    """The chaos section of FAULTS.md is replaced by the next chaos run and survives
    `python3 dev.py faults` rewriting the rest of the file."""
    from devtools.chaos.report import render_markdown, write_faults_md
    from devtools.fault_report import keep_chaos_section

    path = tmp_path / "FAULTS.md"
    path.write_text("# Fault scenarios\n\nrows\n", encoding="utf-8")
    first = {"seed": 1, "phases": [{"build": "correct", "seed": 1, "steps": 3, "violations": []}]}
    write_faults_md(path, render_markdown(first, "python3 dev.py chaos --seed 1"))
    correct = {
        "build": "correct",
        "seed": 2,
        "steps": 500,
        "actions": {"force": 40},
        "invariant_checks": {"x": 2},
        "violations": [],
    }
    broken = {
        "build": "fence-off",
        "broken": True,
        "seed": 5,
        "caught_at_step": 3,
        "caught_after_seconds": 41.5,
        "seconds": 70.2,
        "violations": ["no commit after the lock was lost"],
    }
    second = {"seed": 2, "phases": [correct, broken]}
    write_faults_md(path, render_markdown(second, "python3 dev.py chaos --seed 2"))
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# Fault scenarios\n\nrows\n") and text.count("## Chaos") == 1
    assert "seed **2**" in text and "**500 steps**" in text and "force 40" in text
    assert "| x | 2 |" in text and "seed **1**" not in text
    assert (
        "| `fence-off` |" in text
        and "| 3 | 41.5 | 70.2 | no commit after the lock was lost |" in text
    )
    regenerated = keep_chaos_section(path, "# Fault scenarios\n\nnew rows\n")
    assert regenerated.startswith("# Fault scenarios\n\nnew rows\n")
    assert "seed **2**" in regenerated and regenerated.count("## Chaos") == 1


def test_a_plan_that_runs_out_of_ended_days_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    """Each phase takes business dates after the earlier ones'; a plan whose last phase would
    need a day that has not ended is refused up front (exit 2, naming the phase and the fix),
    not after the earlier phases ran for half an hour without writing their summary."""
    from devtools.chaos import FIRST_DATE, main, parser, phase_dates

    # One date more than the days that have ended since the first business date, whatever today.
    ended = (dt.datetime.now(dt.timezone.utc).date() - FIRST_DATE).days
    steps = str(10 * ended)  # a new date every 10 steps (the default)
    builds = "correct,lock-off,fence-off"
    args = parser().parse_args(["--steps", steps, "--builds", builds])
    with pytest.raises(ValueError, match=r"phase correct:advisory would need business dates up"):
        phase_dates(args)
    with pytest.raises(SystemExit) as refused:
        main(["--steps", steps, "--builds", builds, "--workdir", str(tmp_path / "w")])
    assert refused.value.code == 2 and not (tmp_path / "w").exists()
    fits = parser().parse_args(["--steps", "30", "--builds", builds])
    plan = phase_dates(fits)
    assert [first for first, _ in plan] == sorted({first for first, _ in plan})
    assert all(plan[i][1] < plan[i + 1][0] for i in range(len(plan) - 1))


def test_a_phase_names_its_build_and_lock_mode_or_is_refused() -> None:
    """``--builds NAME:MODE`` runs that phase in lock mode MODE, ``--lock-mode`` every other;
    an unknown build or mode is refused naming the choices."""
    from devtools.chaos import parser
    from devtools.chaos.phases import planned_builds

    args = parser().parse_args(["--builds", "correct,fence-off:lease", "--lock-mode", "lease"])
    assert [(b.name, m) for b, m in planned_builds(args)] == [
        ("correct", "lease"),
        ("fence-off", "lease"),
    ]
    args = parser().parse_args(["--builds", "correct:lease,lock-off"])
    assert [m for _, m in planned_builds(args)] == ["lease", "advisory"]
    for wrong in ("correct:leases", "lock-of:lease", ""):
        with pytest.raises(SystemExit):
            parser().parse_args(["--builds", wrong])
