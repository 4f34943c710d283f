"""Benchmarks and benchmark models: side-by-side numbers, never timing assertions."""
