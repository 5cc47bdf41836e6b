"""The benchmark suite runs end to end at its tiny size and prints its table of figures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support import ROOT

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


def test_bench_tiny_runs_and_prints_the_table(tmp_path: Path) -> None:
    """`python -m bench --size tiny` exits 0, prints every benchmark's rows and a verdict line, and writes the report."""
    report = tmp_path / "BENCHMARKS.md"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "dags"), env.get("PYTHONPATH")) if p
    )
    # The decision benchmark's before/after comparison, with this checkout as "before" (its
    # own .venv): the path runs, and the same code counts the same round trips.
    env["BENCH_BEFORE_CHECKOUT"] = str(ROOT)
    airflow2 = Path(env.get("IDEMPOTENCY_AIRFLOW2_PYTHON", "/nonexistent")).exists()
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--size", "tiny", "--output", str(report)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["benchmark", "figure", "value"], proc.stdout[:500]
    for name in BENCHMARKS:
        assert any(line.startswith(name + " ") for line in lines), (name, proc.stdout)
    assert any("ratio" in line for line in lines)
    # the table's verdict line, then the load average at the start and at the end
    assert lines[-2].startswith("targets: "), lines[-3:]
    assert lines[-1].startswith("load average: ") and "at the end" in lines[-1], lines[-1]
    for figure in ("3.3: round trips, new key", "round trips now - before, new key"):
        assert any(line.startswith("decision") and figure in line for line in lines), figure
    # "before" is this very code: the same round trips, so both comparisons are met.
    trips = [line for line in lines if "round trips now - before" in line]
    assert len(trips) == 2 and all("  ok  " in line for line in trips), trips
    # Airflow 2.11 beside 3.3 when its environment exists (dev.py exports where it is).
    assert (
        any(
            line.startswith("airflow_e2e") and "2.11: ratio idempotent / fair" in line
            for line in lines
        )
        == airflow2
    )
    text = report.read_text(encoding="utf-8")
    assert "| benchmark | figure |" in text and "size `tiny`" in text
