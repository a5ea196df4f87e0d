"""Staged apply: received tensors are held until commit, then loaded under the engine gate in one go.

The engine keeps serving the old version while bytes stream, and an abort just drops the staging
copy; it costs a host copy of the weights. Each bucket is copied out of the sender's buffer and
checked in one pass (weightsync/bus/verified_copy.py) before anything enters the staging copy.
"""

from __future__ import annotations

import functools
import time

import torch

from rollout_svc.sync.apply import ApplyStrategy, SyncHost
from rollout_svc.sync.pending import TIMED_OUT, PendingSync, verify
from weightsync.bus.errors import SyncError
from weightsync.bus.pack import unpack_bucket
from weightsync.bus.plan import BucketPlan
from weightsync.bus.verified_copy import copy_bucket
from weightsync.v1 import rollout_pb2

S = rollout_pb2


class StagedApply(ApplyStrategy):
    mode = "staged"

    def __init__(self, host: SyncHost):
        super().__init__(host)
        self._holding = False  # the commit holds the engine gate (guarded by host.state_lock)

    def consume(
        self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor, sender_checksum: int | None, defer_check: bool
    ) -> tuple[object, bool]:
        ours, deferred = None, False
        if p.manifest.checksum_algo:
            flat, ours = copy_bucket(plan, buf, wait=not defer_check)
            if defer_check:
                p.defer(plan.index, ours, sender_checksum)
                deferred = True
            else:
                verify(plan.index, ours, sender_checksum)
            staged = dict(unpack_bucket(plan, flat))  # views of this sync's own copy
        else:
            staged = {name: view.clone() for name, view in unpack_bucket(plan, buf)}
        with p.lock:
            p.staging.update(staged)
        return ours, deferred

    def take_engine_for_commit(self, p: PendingSync) -> None:
        """Wait until no generation pins the engine, no longer than the sync may last.

        Outside the state lock, so that an abort (the trainer's, SIGTERM's, the timer's) or a newer
        prepare is taken at once rather than after the wait, and ends the wait; the staged weights
        were never applied, so the old version keeps serving either way."""
        host = self.host
        gone = functools.partial(host.left_behind, p)
        if host.engine_lock.acquire(timeout=max(0.0, p.deadline - time.monotonic()), give_up=gone):
            with host.state_lock:
                self._holding = True
            return
        with host.state_lock:
            if not gone():
                host.abort_locked("the engine stayed busy generating until the sync's deadline")
            elif p.error != TIMED_OUT:  # the timer at the same deadline is the same verdict as ours
                raise SyncError(
                    f"sync {p.manifest.sync_id} was aborted while its commit waited for the engine: "
                    f"{p.error or 'superseded'}"
                )
        raise SyncError(
            f"sync {p.manifest.sync_id}: the engine did not become free to apply the weights "
            "before the sync's deadline (a long generation holds it); raise the sync "
            "timeout or lower the rollout's generation limits",
            "DEADLINE_EXCEEDED",
        )

    def apply(self, p: PendingSync) -> None:
        engine = self.host.engine
        self.host.state = S.APPLYING
        engine.load_weights(p.loadable(p.staging.items()))
        p.check_complete()
        engine.flush_cache()

    def release(self) -> None:
        if self._holding:
            self._holding = False
            self.host.engine_lock.release()
