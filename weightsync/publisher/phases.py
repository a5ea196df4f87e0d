"""Seconds spent in each phase of one sync (plan, prepare, stream, commit)."""

from __future__ import annotations

import contextlib
import time


class PhaseClock:
    """Seconds spent in each named phase of one sync (a retried attempt adds to the same phases)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def __str__(self) -> str:
        return " ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items())
