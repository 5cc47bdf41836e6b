"""`python3 dev.py bench NAME --merge`: a benchmark re-measured alone replaces its own rows and
section of BENCHMARKS.md, says when and at what load, and leaves every other one as it was."""

from __future__ import annotations

import datetime as dt

from bench.common import BenchResult
from bench.report import merge_markdown

EXISTING = """# Benchmarks

- Command: `python3 dev.py bench --size full`
- Date: 2026-12-02 15:34 UTC, size `full`, total 39.9 min
- Machine: nproc 2

## Results

| benchmark | figure | value | unit | target | | note |
|---|---|---:|---|---|---|---|
| overhead | no-op, median | 1.66 | ms | <= 2 ms | ok |  |
| scale | old figure | 1 | runs | = 2 | MISSED |  |
| scale | another old figure | 3 | runs |  |  |  |
| invoices | ratio | 0.91 | x | <= 1.3 | ok |  |

Targets: 2 met, 1 missed.

## Overhead

Wall time of this benchmark: 10 s.

overhead notes

## Scale

Wall time of this benchmark: 99 s.

old scale notes

## Invoices

invoice notes

## What these benchmarks changed

1. things
"""


def merged(*results: BenchResult) -> str:
    machine = {"load average": "0.50 0.40 0.30", "load average (end)": "1.10 0.90 0.50"}
    started = dt.datetime(2026, 12, 7, 1, 40, tzinfo=dt.timezone.utc)
    return merge_markdown(EXISTING, results, machine, "python3 dev.py bench scale --merge", started)


def test_a_benchmark_re_measured_alone_replaces_its_rows_and_section_only() -> None:
    scale = BenchResult("scale", "Scale", seconds=120.0, notes=["new scale notes"])
    scale.add("lease, N=1000: completed", 1000, "runs", "= 1000", True)
    text = merged(scale)
    assert "old figure" not in text and "old scale notes" not in text
    assert "| scale | lease, N=1000: completed | 1,000 | runs | = 1000 | ok |  |" in text
    assert text.index("| overhead |") < text.index("| scale |") < text.index("| invoices |")
    assert "overhead notes" in text and "invoice notes" in text
    assert "## Scale\n\nWall time of this benchmark: 120 s.\n\nnew scale notes" in text
    assert "Targets: 3 met, 0 missed." in text
    said = "- Re-measured on 2026-12-07 01:40 UTC (2.0 min): `scale`, by `python3 dev.py bench"
    assert said in text and "load average 0.50 0.40 0.30 at the start" in text
    assert text.index("- Date:") < text.index(said) < text.index("- Machine:")


def test_a_new_benchmark_is_added_before_what_they_changed() -> None:
    new = BenchResult("fresh", "Fresh", seconds=6.0, notes=["fresh notes"])
    new.add("figure", 2.5, "ms", "<= 1 ms", False)
    text = merged(new)
    assert text.index("| invoices |") < text.index("| fresh |") < text.index("Targets:")
    assert text.index("## Invoices") < text.index("## Fresh") < text.index("## What these")
    assert "Targets: 2 met, 2 missed." in text
