"""Diagnostic, not part of the product: times the pieces of a sync inside the trainer-svc and
rollout-svc processes that bench/bench_services.py starts, where no profiler reaches.

Put this folder first on PYTHONPATH (Python imports `sitecustomize` at start-up) and name an
output folder; every service process then wraps a fixed list of functions with timers once their
modules are loaded, and writes `<role>_<pid>.json` there every 2 s (the last 2 s may be lost):

    PYTHONPATH=$PWD/bench/profile:$PYTHONPATH WS_PROF_OUT=/tmp/prof \
        python3 bench/bench_services.py --models 1.5b --transport ipc --reps 15
    python3 bench/profile/summarize.py /tmp/prof    # medians, and the last syncs' timelines

Both services read time.perf_counter (CLOCK_MONOTONIC, one clock for the whole host), so their
events line up on one timeline.
"""

import functools
import json
import os
import sys
import threading
import time

OUT = os.environ.get("WS_PROF_OUT")
T: dict[str, list[float]] = {}  # piece -> seconds of each call
EV: list[tuple[str, float, float]] = []  # (piece, start, end) on the host's monotonic clock
_lock = threading.Lock()

ROLLOUT = [
    ("weightsync.bus.ipc.receiver", "IpcReceiver", "push", "r.push"),
    ("weightsync.bus.ipc.handles", "MappedBuffers", "get", "r.maps.get"),
    ("rollout_svc.sync.transaction", "SyncTransaction", "consume_bucket", "r.consume_bucket"),
    ("rollout_svc.sync.apply_inplace", "InPlaceApply", "_pause_engine", "r.pause_engine"),
    ("rollout_svc.sync.transaction", "SyncTransaction", "prepare", "r.tx.prepare"),
    ("rollout_svc.sync.transaction", "SyncTransaction", "commit", "r.tx.commit"),
    ("rollout_svc.sync.apply_inplace", None, "bucket_checksum", "r.bucket_checksum"),
    ("rollout_svc.sync.apply_inplace", None, "copy_into", "r.copy_into"),
    ("rollout_svc.service", "RolloutServicer", "_commit", "r._commit"),
    ("rollout_svc.service", "RolloutServicer", "PrepareSync", "r.PrepareSync"),
]
TRAINER = [
    ("weightsync.publisher.stream_phase", "StreamPhase", "_send", "t._send"),
    ("weightsync.publisher.attempt", "SyncAttempt", "stream", "t.stream"),
    ("weightsync.publisher.stream_phase", None, "stream_buckets", "t.stream_buckets"),
    ("weightsync.bus.ipc.sender", "IpcStreamSender", "send", "t.send"),
    ("weightsync.bus.ipc.sender", "IpcStreamSender", "flush", "t.flush"),
    ("weightsync.bus.ipc.sender", "IpcStreamSender", "_await", "t._await"),
    ("weightsync.bus.ipc.sender", "_IpcSession", "open", "t.session.open"),
    ("weightsync.bus.ipc.sender", "_IpcSession", "finish", "t.session.finish"),
    ("weightsync.bus.checksum", "InFlightChecksums", "value", "t.csum.value"),
    ("weightsync.bus.checksum", "InFlightChecksums", "values", "t.csum.values"),
]


def _wrap(obj, name: str, key: str) -> None:
    f = getattr(obj, name)

    @functools.wraps(f)
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            t1 = time.perf_counter()
            with _lock:
                T.setdefault(key, []).append(t1 - t0)
                EV.append((key, t0, t1))

    setattr(obj, name, timed)


def _patch() -> None:
    """Wait (up to 5 min) until this process has loaded one service's modules, then wrap its list."""
    for _ in range(6000):
        loaded = sys.modules
        for role, pieces in (("rollout", ROLLOUT), ("trainer", TRAINER)):
            if all(mod in loaded for mod, _, _, _ in pieces):
                # a module is in sys.modules from the start of its import: wait until every piece is
                # defined (an AttributeError here would end this thread, and that service go untimed)
                try:
                    owners = [(loaded[mod] if cls is None else getattr(loaded[mod], cls)) for mod, cls, _, _ in pieces]
                    if not all(hasattr(o, name) for o, (_, _, name, _) in zip(owners, pieces)):
                        continue
                except AttributeError:
                    continue
                for owner, (_, _, name, key) in zip(owners, pieces):
                    _wrap(owner, name, key)
                threading.Thread(target=_dump, args=(role,), daemon=True).start()
                return
        time.sleep(0.05)


def _dump(role: str) -> None:
    while True:
        time.sleep(2)
        with _lock:
            data = {"role": role, "T": T, "EV": EV[-4000:]}
        with open(os.path.join(OUT, f"{role}_{os.getpid()}.json"), "w") as f:
            json.dump(data, f)


if OUT:
    threading.Thread(target=_patch, daemon=True).start()
