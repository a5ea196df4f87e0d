"""Seconds spent in each phase of one sync (plan, prepare, stream, commit), and where it stands now."""

from __future__ import annotations

import contextlib
import time

from weightsync.obs import tracing


class PhaseClock:
    """Seconds spent in each named phase of one sync (a retried attempt adds to the same phases).

    `current` and `bytes_sent` say where the sync stands while it runs (GetSyncProgress, wsctl): read
    from other threads without a lock, each a single attribute written whole."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        #: the phase running now ("" between phases and once the sync ended)
        self.current = ""
        #: bytes the stream has handed to the bus so far (this attempt; the sender's own count)
        self.bytes_sent = 0
        self.started = time.monotonic()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def progress(self, bytes_sent: int) -> None:
        self.bytes_sent = bytes_sent

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        self.current = name
        try:
            with tracing.phase(name):  # a span of the sync's trace when tracing is on
                yield
        finally:
            self.current = ""
            self.add(name, time.perf_counter() - t0)

    def __str__(self) -> str:
        return " ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items())
