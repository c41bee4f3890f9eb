"""kvquant's benchmarks and the test/benchmark harness (not part of the installed package)."""
