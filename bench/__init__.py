"""Benchmarks, run from a checkout (`python bench/<script>.py`); the runs they record live in bench/results/."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def default_out(kind: str) -> str:
    """Where a run is written when no --out is given: bench/results/results_<kind>_<UTC date and time>.json."""
    return str(RESULTS / f"results_{kind}_{time.strftime('%Y-%m-%d_%H%M%S', time.gmtime())}.json")


def cuda_median_s(fn: Callable[[], object], reps: int, warm: bool = True) -> float:
    """Median seconds of `fn` on the GPU, synchronized around each call; `warm` runs it once first
    (compiles its kernels, fills the allocator's cache)."""
    import torch

    if warm:
        fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)
