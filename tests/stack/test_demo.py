"""The guided demo (`python3 dev.py demo --quick`) runs end to end and every one of its checks passes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

TIMEOUT = 1500  # seconds; ~5 min alone on 2 cores, much more when the machine is busy


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 120)
def test_quick_demo_passes_all_its_checks(tmp_path: Path) -> None:
    """`python -m devtools.demo --quick` exits 0 and reports every step's outcome, leaving no process behind."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "dags"), env.get("PYTHONPATH")) if p
    )
    command = [
        sys.executable,
        "-m",
        "devtools.demo",
        "--quick",
        "--workdir",
        str(tmp_path / "demo"),
    ]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the demo stops everything it started on SIGINT
        out, _ = proc.communicate(timeout=120)
        pytest.fail(f"the demo did not finish in {TIMEOUT} s:\n{out[-5000:]}")
    assert proc.returncode == 0, out[-8000:]
    for expected in (
        "200 orders -> 200 invoices created -> 200 exports sent",
        "one finance summary email sent; the export file has 200 invoices",
        "every job recorded a noop attempt: the date was already completed",
        "no second finance summary email",
        "the export file left alone: same content, modification time and inode",
        "lock_held attempt(s): the second run was blocked by the lock",
        "each job completed exactly once; the blocked run then no-op'ed",
        "3 backfill runs, all success",
        "attempts of the second pass are no-ops (every job, every date)",
        "0 requests to the accounting service",
        "the worker was SIGKILLed at ledger.after_remote_commit@70",
        "120 remote invoices for 120 orders: no duplicate",
        "no duplicates: exactly one remote invoice per order",
        "finance summary emails, one per date, none twice",
        "All checks passed",
        "no process left running",
    ):
        assert expected in out, f"missing {expected!r} in:\n{out[-8000:]}"
    assert "DEMO FAILED" not in out
    assert not (tmp_path / "demo").exists()  # removed after a successful run without --keep
