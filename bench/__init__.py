"""Benchmark scripts built on server.py: `python -m bench.compare` runs the performance comparison."""
