"""Benchmarks: `python -m bench list` names them, `python -m bench <name> [args]` runs one, `python -m bench
recipe <name>` runs a named GPU recipe (docs/BENCHMARKS.md). Their results: bench/results/ (bench/common/results.py)."""
