"""The broken builds of chaos (devtools/chaos/builds.py), each without Airflow: its patches
apply to today's provider, they really remove the guarantee, and the invariant meant to
catch it does, while this checkout's provider, in the very same scenario, breaks nothing;
in both lock modes (the advisory lock, and the lease: docs/locks.md).

Seconds per build: the proof that the checker has teeth even where the full chaos run of
tests/faults/test_chaos.py is not run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devtools.chaos.builds import BROKEN, BUILDS, LOCK_MODES, patched_copy
from support import ROOT, TESTS

pytestmark = pytest.mark.airflow_processes

SCENARIO = TESTS / "support" / "broken_build_scenario.py"
EXPOSED_BY = {
    "lock-off": "lock",
    "completed-check-off": "completed",
    "fence-off": "fence",
    "skip-confirmed": "resend",
}


def scenario(dsn: str, name: str, provider_folder: Path | None, mode: str) -> dict[str, Any]:
    path = [str(p) for p in (provider_folder, ROOT, ROOT / "dags") if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(SCENARIO), dsn, name, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_every_broken_build_has_a_scenario() -> None:
    """Each broken build is exposed here by a scenario, and names invariants that exist."""
    from devtools.invariants import INVARIANTS

    assert set(EXPOSED_BY) == set(BROKEN)
    names = {i.name for i in INVARIANTS}
    assert all(set(BUILDS[b].caught_by) <= names for b in BROKEN)


@pytest.mark.parametrize("mode", LOCK_MODES)
@pytest.mark.parametrize("build", BROKEN)
def test_broken_build_is_caught_where_the_correct_one_is_not(
    build: str, mode: str, pg_server: Any, tmp_path: Path
) -> None:
    """The scenario that exposes the build, in lock mode ``mode``: this checkout's provider
    violates nothing, the patched copy violates an invariant the build names."""
    name = EXPOSED_BY[build]
    correct_db = pg_server.create_database("idem_build")
    broken_db = pg_server.create_database("idem_build")
    try:
        correct = scenario(pg_server.dsn(correct_db), name, None, mode)
        copy = patched_copy(BUILDS[build], tmp_path / build)
        broken = scenario(pg_server.dsn(broken_db), name, copy, mode)
    finally:
        pg_server.drop_database(correct_db)
        pg_server.drop_database(broken_db)
    assert correct["provider"].startswith(str(ROOT / "provider")), correct
    assert correct["violated"] == [], correct
    assert (correct["lease_tokens"] > 0) == (mode == "lease"), correct  # the mode was used
    assert (broken["lease_tokens"] > 0) == (mode == "lease"), broken
    assert broken["provider"].startswith(str(copy)), broken
    assert set(broken["violated"]) & set(BUILDS[build].caught_by), broken
    print(f"{build} ({name}, {mode}): correct {correct['outcomes']}, broken {broken}")
