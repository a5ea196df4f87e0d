"""One re-armable deadline on one long-lived thread: the prepared sync's timeout.

A rollout holds at most one prepared sync, so one alarm serves every sync of the process; a
threading.Timer per prepare started (and left behind) a thread per sync, work the steady state
does not need on a path whose fixed cost we count in milliseconds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class Alarm:
    def __init__(self, name: str = "alarm"):
        self._cond = threading.Condition(threading.Lock())
        self._at: float | None = None
        self._fn: Callable[[], None] | None = None
        self._name = name
        self._thread: threading.Thread | None = None
        #: when the thread's timed wait ends and it looks again (None: it waits for a notify, or runs)
        self._wakes_at: float | None = None
        #: notifies sent (tests: a steady prepare/commit cycle sends none)
        self.wakeups = 0

    def arm(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Call `fn` once, `delay_s` from now, on the alarm's thread; replaces what was armed."""
        with self._cond:
            at = time.monotonic() + delay_s
            self._at, self._fn = at, fn
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            # Woken only when its wait ends too late for this deadline: at every sync's prepare the
            # thread still waits for the previous sync's (earlier) deadline, and a wake-up here would
            # take the GIL from the prepare's handler for nothing.
            if self._wakes_at is None or at < self._wakes_at:
                self.wakeups += 1
                self._cond.notify()

    def cancel(self) -> None:
        """Nothing is called (no wake-up: the thread finds nothing armed when its wait ends)."""
        with self._cond:
            self._at, self._fn = None, None

    @property
    def armed(self) -> bool:
        return self._at is not None

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._at is None:
                    self._wakes_at = None
                    self._cond.wait()
                    continue
                left = self._at - time.monotonic()
                if left > 0:
                    self._wakes_at = self._at
                    self._cond.wait(left)
                    continue
                fn, self._at, self._fn, self._wakes_at = self._fn, None, None, None
            try:
                fn()  # outside the lock: fn may take locks whose holders cancel or re-arm
            except Exception:  # noqa: BLE001 — the thread serves every later deadline; log and go on
                log.exception("%s: the armed call failed", self._name)
