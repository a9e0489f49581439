"""The project itself: its house, docs, examples, packaging, benchmarks and test helpers."""
