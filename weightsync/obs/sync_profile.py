"""An opt-in profile of where the trainer's syncs spend their host time (the config's `debug.profile_syncs=<path>`).

A sync of a model on one GPU costs milliseconds, most of them fixed: Python on the sync's path
(planning, the prepare, launches, reading checksums) rather than bytes. The per-phase times in the
sync report say which phase; this says which functions. Off by default (cProfile slows the code it
watches): with the switch set, every sync of this process but its first runs under one cProfile,
and the accumulated statistics are written to `<path>.<pid>` (pstats format) after each sync, outside
the sync's own timing. The first sync is left out because its one-time work (planning the layout,
loading the kernels: tens of milliseconds) would swamp the steady state that repeats.
Read them with `python -m pstats <file>` or `bench/profile_summary.py`.
"""

from __future__ import annotations

import cProfile
import logging
import os
from contextlib import contextmanager

from weightsync.debug import switches

log = logging.getLogger(__name__)

#: how the switch is named where a log line mentions it
SWITCH = "debug.profile_syncs"


class SyncProfile:
    def __init__(self):
        path = switches().profile_syncs
        self.path = f"{path}.{os.getpid()}" if path else ""
        self._prof = cProfile.Profile() if path else None
        self._seen = 0  # syncs so far: the first is not profiled
        if self._prof is not None:
            log.warning("%s is set: every sync runs under cProfile (slower); statistics in %s", SWITCH, self.path)

    @contextmanager
    def watching(self):
        """Profile the block (a sync's own work) when enabled, from the process's second sync on."""
        self._seen += 1
        if self._prof is None or self._seen == 1:
            yield
            return
        self._prof.enable()
        try:
            yield
        finally:
            self._prof.disable()

    def flush(self) -> None:
        """Write the statistics so far (after a sync, outside its timing)."""
        if self._prof is not None and self._seen > 1:
            self._prof.dump_stats(self.path)
