"""Benchmarks: scripts (`python benchmarks/compare.py`) and the workers they start."""
