"""Side-by-side measurements: ``python -m benchmarks.run`` (see docs/benchmarks.md)."""
