"""Diagnostic, not part of the product: times the pieces of a sync inside the trainer-svc and
rollout-svc processes that bench/bench_services.py starts, where no profiler reaches.

Put this folder first on PYTHONPATH (Python imports `sitecustomize` at start-up) and name an
output folder; every service process then wraps a fixed list of functions with timers once their
modules are loaded, and writes `<role>_<pid>.json` there every 2 s (the last 2 s may be lost):

    PYTHONPATH=$PWD/bench/profile:$PYTHONPATH WS_PROF_OUT=/tmp/prof \
        python3 bench/bench_services.py --models 1.5b --transport ipc --reps 15
    python3 bench/profile/summarize.py /tmp/prof    # medians, and the last syncs' timelines

Both services read time.perf_counter (CLOCK_MONOTONIC, one clock for the whole host), so their
events line up on one timeline. The summary also prints the last syncs whole (`t.sync`): plan, the
PrepareSync and CommitSync calls in their two halves on the trainer (`t.link.send`, `t.link.answer`)
against the rollout's handlers, and the trainer_writes write pass, e.g. for a colocated 7B sync:

    PYTHONPATH=$PWD/bench/profile:$PYTHONPATH WS_PROF_OUT=/tmp/prof python3 bench/bench_services.py \
        --models 7b --transport ipc --backend megatron --ipc-direction trainer_writes --reps 10

A piece not found once its module has loaded (renamed since) is named in the summary, the others timed.
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
    ("rollout_svc.sync.apply_inplace", None, "copy_into", "r.copy_into"),
    ("rollout_svc.service", "RolloutServicer", "_commit", "r._commit"),
    ("rollout_svc.service", "RolloutServicer", "PrepareSync", "r.PrepareSync"),
    # the fixed cost of a sync (bench/bench_sync_fixed_cost.py): the handlers on the sync link, the
    # trainer_writes pause, the apply at commit
    ("rollout_svc.sync.link_server", "SyncLinkServer", "_dispatch", "r.link.dispatch"),
    ("weightsync.bus.ipc.receiver", "IpcReceiver", "receive", "r.ipc.receive"),
    ("rollout_svc.sync.transaction", "SyncTransaction", "accept_trainer_writes", "r.accept_writes"),
    ("rollout_svc.sync.apply_inplace", "InPlaceApply", "apply", "r.apply"),
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
    ("weightsync.bus.copy.checksum", "InFlightChecksums", "value", "t.csum.value"),
    ("weightsync.bus.copy.checksum", "InFlightChecksums", "values", "t.csum.values"),
    # the fixed cost of a sync: its phases, the sync-link calls in their two halves, the write pass
    ("weightsync.publisher.orchestrator", "SyncOrchestrator", "_sync_locked", "t.sync"),
    ("weightsync.publisher.orchestrator", "SyncOrchestrator", "_plan", "t.plan"),
    ("weightsync.publisher.attempt", "SyncAttempt", "prepare", "t.prepare"),
    ("weightsync.publisher.attempt", "SyncAttempt", "commit", "t.commit"),
    ("weightsync.publisher.stream_phase", "StreamPhase", "start_in_place", "t.in_place"),
    ("weightsync.publisher.link_client", "SyncLinkClient", "send", "t.link.send"),
    ("weightsync.publisher.link_client", "SyncLinkClient", "_answer_of", "t.link.answer"),
    ("weightsync.bus.ipc.trainer_writes", "TrainerWriteSender", "send_held", "t.tw.send_held"),
    ("weightsync.bus.ipc.trainer_writes", "TrainerWriteSender", "flush", "t.tw.flush"),
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


#: wrapped whenever their module loads, in any service (a megatron trainer's flat export, imported at
#: its first sync; absent from an hf trainer): the parts of `t.in_place` and of the write pass
OPTIONAL = [
    ("trainer_svc.actor.megatron.flat_buckets", "FlatBuckets", "whole", "t.mg.flat_whole"),
    ("trainer_svc.actor.megatron.flat_export", "FlatExport", "stale", "t.mg.stale"),
    ("trainer_svc.actor.megatron.flat_export", "FlatExport", "refresh", "t.mg.refresh"),
    ("weightsync.bus.copy.copy_runs", "BatchedCopy", "run", "t.copy_runs"),
    ("weightsync.bus.copy.verified_copy", None, "copy_all_into", "t.copy_all_into"),
    ("weightsync.bus.copy.verified_copy", None, "pending_values", "pending_values"),
]

#: pieces not found once their modules had loaded (a renamed function): written with the timings
MISSING: list[str] = []


def _owner(loaded, mod: str, cls: str | None, name: str):
    owner = loaded[mod] if cls is None else getattr(loaded[mod], cls, None)
    return owner if owner is not None and hasattr(owner, name) else None


def _patch() -> None:
    """Wait (up to 5 min) until this process has loaded one service's modules, then wrap its list."""
    since: dict[str, float] = {}  # role -> when all its modules were first seen in sys.modules
    for _ in range(6000):
        loaded = sys.modules
        for role, pieces in (("rollout", ROLLOUT), ("trainer", TRAINER)):
            if all(mod in loaded for mod, _, _, _ in pieces):
                # a module is in sys.modules from the start of its import: wait until every piece is
                # defined, or 10 s (a piece renamed since: the others are still timed, it is named)
                owners = [_owner(loaded, mod, cls, name) for mod, cls, name, _ in pieces]
                first = since.setdefault(role, time.monotonic())
                if None in owners and time.monotonic() - first < 10:
                    continue
                for owner, (_, _, name, key) in zip(owners, pieces):
                    if owner is None:
                        MISSING.append(key)
                    else:
                        _wrap(owner, name, key)
                threading.Thread(target=_dump, args=(role,), daemon=True).start()
                threading.Thread(target=_patch_optional, daemon=True).start()
                return
        time.sleep(0.05)


def _patch_optional() -> None:
    """Wrap each OPTIONAL piece once its module has loaded (polled for 10 minutes)."""
    left = list(OPTIONAL)
    for _ in range(12000):
        for piece in list(left):
            mod, cls, name, key = piece
            if mod in sys.modules:
                owner = _owner(sys.modules, mod, cls, name)
                if owner is not None:
                    _wrap(owner, name, key)
                    left.remove(piece)
        if not left:
            return
        time.sleep(0.05)


def _dump(role: str) -> None:
    while True:
        time.sleep(2)
        with _lock:
            data = {"role": role, "T": T, "EV": EV[-4000:], "missing": MISSING}
        with open(os.path.join(OUT, f"{role}_{os.getpid()}.json"), "w") as f:
            json.dump(data, f)


if OUT:
    threading.Thread(target=_patch, daemon=True).start()
