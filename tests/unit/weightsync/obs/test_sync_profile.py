"""debug.profile_syncs: a sync's host time by function, written after each sync; nothing without it."""

from __future__ import annotations

import os
import pstats

from weightsync import debug
from weightsync.obs.sync_profile import SyncProfile


def _busy_sync_step():
    return sum(i * i for i in range(20000))


def test_a_profile_is_written_per_process_with_the_watched_functions_from_the_second_sync(tmp_path, monkeypatch):
    monkeypatch.setattr(debug, "_current", debug.Switches(profile_syncs=str(tmp_path / "trainer.pstats")))
    prof = SyncProfile()
    for _ in range(3):  # the first sync (one-time planning and kernel loads) is left out
        with prof.watching():
            _busy_sync_step()
        prof.flush()
    _busy_sync_step()  # outside a sync: not counted
    path = tmp_path / f"trainer.pstats.{os.getpid()}"
    assert prof.path == str(path)
    calls = {fn[2]: stat[1] for fn, stat in pstats.Stats(str(path)).stats.items()}
    assert calls["_busy_sync_step"] == 2


def test_without_the_switch_nothing_is_profiled_or_written(tmp_path, monkeypatch):
    monkeypatch.setattr(debug, "_current", debug.Switches())
    monkeypatch.chdir(tmp_path)
    prof = SyncProfile()
    with prof.watching():
        _busy_sync_step()
    prof.flush()
    assert prof.path == "" and list(tmp_path.iterdir()) == []
