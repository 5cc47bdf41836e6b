"""Developer tooling shared by the test suite, the demo and the benchmarks (not shipped)."""
