"""Fault points armed from outside: exactly one of many processes claims an armed crash."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_an_armed_crash_kills_exactly_one_process(tmp_path: Path) -> None:
    """Four processes pass the point after a crash is armed there: one is SIGKILLed, the
    others go on; a point not armed kills nobody."""
    (tmp_path / "ledger.after_claim").touch()
    code = (
        "import time; from airflow_idempotency.crashpoints import crash_point;"
        "crash_point('runner.after_lock'); time.sleep(0.2); crash_point('ledger.after_claim')"
    )
    env = {**os.environ, "AIRFLOW_IDEMPOTENCY_FAULT_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(4)]
    codes = sorted(p.wait(timeout=60) for p in procs)
    assert codes == [-9, 0, 0, 0]
    assert [p.name.split(".claimed-by-")[0] for p in tmp_path.iterdir()] == ["ledger.after_claim"]


def test_an_armed_stall_pauses_exactly_one_process(tmp_path: Path) -> None:
    """Four processes pass a point with a 2-second stall armed there: one of them stalls that
    long and then goes on, the others pass at once; the claimed file names the staller."""
    (tmp_path / "runner.after_started.stall").write_text("2")
    code = (
        "import os, time; from airflow_idempotency.crashpoints import crash_point;"
        "t = time.monotonic(); crash_point('runner.after_started');"
        "print(os.getpid(), round(time.monotonic() - t, 2))"
    )
    env = {**os.environ, "AIRFLOW_IDEMPOTENCY_FAULT_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    results = [p.communicate(timeout=60)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0]
    stalled = [pid for pid, seconds in results if float(seconds) >= 2]
    assert len(stalled) == 1, results
    assert max(float(s) for pid, s in results if pid not in stalled) < 1, results
    assert [p.name for p in tmp_path.iterdir()] == [
        f"runner.after_started.stall.claimed-by-{stalled[0]}"
    ]
