"""Suite-wide: a test marked `serial` runs alone while pytest-xdist runs the suite on several workers.

Such tests compare timings (a ratio against a baseline of the same run, a bound a fraction of a second
over a timeout): on a 2-core CI machine, a second worker starting services beside them is load that
lands on one side of the comparison only. Every worker takes a shared lock around each test and a
`serial` one an exclusive lock, through one lock file per run; a gate taken first makes the others
queue behind a waiting serial test instead of keeping it out. Without xdist this does nothing.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path

import pytest

# the workers of one run share this id (pytest-xdist sets it): other runs on the machine use other files
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
# longer than any one test may take (pytest-timeout's 600 s) plus a queued serial one before it
_WAIT_S = 1500.0


def _lock(f, mode: int, what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while True:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what}: {f.name} still held by another xdist worker after {_WAIT_S:.0f}s"
                ) from None
            time.sleep(0.02)


# outermost (tryfirst): pytest-timeout's timer, started inside, counts the test and not its wait here
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if not _RUN:
        return (yield)
    base = Path(tempfile.gettempdir()) / f"weightsync-xdist-{_RUN}"
    serial = item.get_closest_marker("serial") is not None
    with open(f"{base}.gate", "a+") as gate, open(f"{base}.lock", "a+") as lock:
        _lock(gate, fcntl.LOCK_EX, item.nodeid)
        try:
            _lock(lock, fcntl.LOCK_EX if serial else fcntl.LOCK_SH, item.nodeid)
        finally:
            if not serial:  # a serial test keeps the gate: the others wait there until it is done
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if serial:
                fcntl.flock(gate, fcntl.LOCK_UN)
