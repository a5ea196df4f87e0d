"""Benchmarks, run from a checkout (`python bench/<script>.py`); the runs they record live in bench/results/."""

from __future__ import annotations

import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def default_out(kind: str) -> str:
    """Where a run is written when no --out is given: bench/results/results_<kind>_<UTC date and time>.json."""
    return str(RESULTS / f"results_{kind}_{time.strftime('%Y-%m-%d_%H%M%S', time.gmtime())}.json")
