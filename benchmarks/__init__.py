"""Benchmarks: run each file with ``python benchmarks/<name>.py``; they print times and ratios."""
