"""Timers and summaries shared by the benches: wall-clock and CUDA-synchronized medians, percentiles."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def percentile(xs: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) by the nearest lower rank, as the benches have always reported p90/p99."""
    if not xs:
        raise ValueError("percentile of no samples: run at least one repetition (--reps)")
    s = sorted(xs)
    return s[int(q / 100 * (len(s) - 1))]


def summary(xs: Sequence[float]) -> dict[str, float]:
    """median, p90, min and max of samples in seconds, keyed `*_s` as the result schema wants."""
    return {"median_s": median(xs), "p90_s": percentile(xs, 90), "min_s": min(xs), "max_s": max(xs)}


def timed(fn: Callable, into: list[float]) -> Callable:
    """`fn` wrapped to append the seconds of each call to `into` (also when it raises)."""

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into.append(time.perf_counter() - t0)

    return wrapper


def wall_samples(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `reps` calls of `fn` after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


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
