"""Daemon threads kept across syncs for work each sync hands off (the pipeline's producer).

Starting a thread per sync puts its creation and its join on the path of every sync (tens of
microseconds each, more on a loaded host) for a sync whose fixed cost is a millisecond or two;
tests/unit/weightsync/publisher/test_sync_fixed_work.py counts the threads a steady-state sync
starts (none). The threads are daemons, as the per-sync ones were: one stuck in a call that never
returns (a hung device) must not keep the process from exiting.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Job:
    """One handed-off call: `join` waits for its end, as Thread.join does."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn
        self._done = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def run(self, ended: Callable[[], None]) -> None:
        """Run the call; `ended()` (its worker is idle again) comes before `join` returns, so that a job
        submitted right after the join takes this worker rather than a new thread."""
        try:
            self.fn()
        except BaseException:  # the caller's own fn hands its errors on; nothing may end the worker
            log.exception("a handed-off job failed")
        finally:
            self.fn = None  # (whatever it holds is freed with the call, not kept until the next)
            ended()
            self._done.set()


class Workers:
    """Run each submitted call on an idle worker thread of this set, or on a new one when all are busy."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0

    @property
    def started(self) -> int:
        """Threads this set has started (a new one only when every earlier one was busy)."""
        return self._started

    def submit(self, fn: Callable[[], None]) -> Job:
        job = Job(fn)
        with self._lock:
            if self._idle:
                self._idle -= 1  # that worker is taken: the job waits for no other
            else:
                self._started += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._started}", daemon=True).start()
        self._jobs.put(job)
        return job

    def _work(self) -> None:
        while True:
            self._jobs.get().run(self._idle_again)

    def _idle_again(self) -> None:
        with self._lock:
            self._idle += 1
