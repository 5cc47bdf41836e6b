"""Benchmarks of airflow-provider-idempotency: ``python -m bench --size full``.

Each benchmark module measures the provider next to a bare baseline in the same run and
returns :class:`bench.common.Row` figures; ``bench.__main__`` prints them as one table and
writes ``BENCHMARKS.md``. Not part of the test suite (``tests/stack/test_bench_smoke.py`` only
runs the tiny size).
"""
