"""Fault points: crash or stall this process at a named point, chosen by configuration.

For tests and demos of crash recovery; no code is edited to inject a fault.

- ``AIRFLOW_IDEMPOTENCY_CRASH_AT="ledger.after_remote_commit@250"`` SIGKILLs the process
  the 250th time that point is reached (``@N`` defaults to 1);
- ``AIRFLOW_IDEMPOTENCY_SLEEP_AT="runner.after_started=8"`` sleeps 8 seconds there, the
  first time the point is reached;
- ``AIRFLOW_IDEMPOTENCY_WAIT_AT="runner.after_started=/tmp/go"`` waits there until that
  file exists (at most 10 minutes), the first time the point is reached.

- ``AIRFLOW_IDEMPOTENCY_FAULT_DIR=/tmp/faults``: a process SIGKILLs itself at a point when
  a file of that point's name is in the folder, and it is the process that claims it (it
  renames the file away, atomically): a test arms a crash for exactly one of many worker
  processes, at a moment it chooses, by creating ``/tmp/faults/ledger.after_remote_commit``.
  A file ``<point>.stall`` there holding a number of seconds stalls (rather than kills)
  the one process that claims it, that long at the point: a window in which a test can,
  say, end that run's lock session. A stall and a crash armed at one point both happen.

Several points may be given, comma-separated. With none of these set (the normal case)
a fault point costs four dictionary lookups (:mod:`airflow_idempotency._environ`). The
ledger reaches some points from its worker threads: ``@N`` counts every thread's hits (the
N-th of the process kills it).

Points: runner.after_lock, runner.after_started, runner.before_completion,
ledger.after_claim, ledger.after_intent (a remote that does not deduplicate: the intent is
committed, the call not made), ledger.before_remote_call, ledger.after_remote_commit,
ledger.before_record_outcomes, files.after_write (an output file staged, not committed),
files.after_rename (moved into place, not recorded), and the example's
invoices.before_commit, invoices.after_commit, totals.after_delete.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import Counter

from airflow_idempotency import _environ

CRASH_ENV = "AIRFLOW_IDEMPOTENCY_CRASH_AT"
SLEEP_ENV = "AIRFLOW_IDEMPOTENCY_SLEEP_AT"
WAIT_ENV = "AIRFLOW_IDEMPOTENCY_WAIT_AT"
FAULT_DIR_ENV = "AIRFLOW_IDEMPOTENCY_FAULT_DIR"
_hits: Counter[str] = Counter()
_hits_lock = threading.Lock()  # the ledger's worker threads reach points too
_slept: dict[str, bool] = {}


def _parse(spec: str, separator: str) -> dict[str, str]:
    entries: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition(separator)
        entries[name] = value
    return entries


def crash_point(name: str) -> None:
    """Crash (SIGKILL), sleep or wait here if ``name`` is configured; otherwise do nothing."""
    get = _environ.get
    fault_dir = get(FAULT_DIR_ENV)
    if fault_dir is not None:
        _armed_stall(fault_dir, name)
        _armed_crash(fault_dir, name)
    crashes, sleeps, waits = get(CRASH_ENV), get(SLEEP_ENV), get(WAIT_ENV)
    if crashes is None and sleeps is None and waits is None:
        return
    pause = _parse(sleeps or "", "=").get(name)
    gate = _parse(waits or "", "=").get(name)
    if (pause or gate) and not _slept.get(name):
        _slept[name] = True
        print(f"fault point {name}: pausing ({pause or gate})", file=sys.stderr, flush=True)
        if pause:
            time.sleep(float(pause))
        deadline = time.monotonic() + 600
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.1)
    nth = _parse(crashes or "", "@").get(name)
    if nth is None:
        return
    # The kill happens while the lock is held: the print releases the GIL, and another thread
    # must not pass this point (as hit nth + 1, which kills nobody) and go on to record its
    # outcome meanwhile: the process dies at the nth hit, as if nothing ran after it.
    with _hits_lock:
        _hits[name] += 1
        if _hits[name] == int(nth or 1):
            print(f"fault point {name}@{nth or 1}: SIGKILL", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def _claim(armed: str) -> str | None:
    """The claimed name of the armed file, if this process won it (a rename is atomic: one
    process wins); None if it is not armed or another process claimed it first."""
    if not os.path.exists(armed):
        return None
    claimed = f"{armed}.claimed-by-{os.getpid()}"
    try:
        os.rename(armed, claimed)
    except OSError:
        return None
    return claimed


def _armed_crash(folder: str, name: str) -> None:
    """SIGKILL this process if a crash is armed at ``name`` and this process claims it."""
    if _claim(os.path.join(folder, name)) is None:
        return
    print(f"fault point {name}: armed crash claimed, SIGKILL", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _armed_stall(folder: str, name: str) -> None:
    """Sleep the seconds written in ``<name>.stall`` if this process claims that file."""
    claimed = _claim(os.path.join(folder, f"{name}.stall"))
    if claimed is None:
        return
    with open(claimed, encoding="ascii") as armed:
        seconds = float(armed.read().strip() or 0)
    print(f"fault point {name}: armed stall claimed ({seconds} s)", file=sys.stderr, flush=True)
    time.sleep(seconds)
