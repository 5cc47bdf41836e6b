"""The benchmark suite runs end to end at its tiny size and prints its table of figures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ("overhead", "decision", "contention", "invoices", "export", "airflow_e2e", "ui")


def test_bench_tiny_runs_and_prints_the_table(tmp_path: Path) -> None:
    """`python -m bench --size tiny` exits 0, prints every benchmark's rows and a verdict line, and writes the report."""
    report = tmp_path / "BENCHMARKS.md"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "dags"), env.get("PYTHONPATH")) if p
    )
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--size", "tiny", "--output", str(report)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["benchmark", "figure", "value"], proc.stdout[:500]
    for name in BENCHMARKS:
        assert any(line.startswith(name + " ") for line in lines), (name, proc.stdout)
    assert any("ratio" in line for line in lines)
    assert lines[-1].startswith("targets: ")
    text = report.read_text(encoding="utf-8")
    assert "| benchmark | figure |" in text and "size `tiny`" in text
