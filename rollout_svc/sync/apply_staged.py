"""Staged apply: received tensors are held until commit, then loaded under the engine gate in one go.

The engine keeps serving the old version while bytes stream, and an abort just drops the staging
copy; it costs a host copy of the weights. Each bucket is copied out of the sender's buffer and
checked in one pass (weightsync/bus/copy/verified_copy.py) before anything enters the staging copy.

A block-FP8 bucket for an engine that dequantizes is staged as received (its FP8 bytes) and, at
commit, after every checksum has been verified, written from there into the parameters by one
dequantizing launch per bucket where the engine offers them (fp8_fused_write.py); nothing reaches a
served parameter before that.

A delta bucket (rollout_svc/sync/delta_base.py) is checked from the base copy's word sums instead;
where the engine holds exactly the base copy's bytes, in parameters of the bucket's layout (shown
at an earlier commit, which wrote them byte for byte), only the changed words are staged and written
at commit (sparse_write.py); otherwise the whole bucket is staged as above.
"""

from __future__ import annotations

import functools
import time

import torch

from rollout_svc.sync import fp8_fused_write
from rollout_svc.sync.apply import ApplyStrategy, SyncHost
from rollout_svc.sync.pending import TIMED_OUT, PendingSync, verify
from rollout_svc.sync.sparse_write import slot_words, writable, write
from weightsync.bus.copy.verified_copy import copy_bucket
from weightsync.bus.errors import SyncError
from weightsync.bus.pack import unpack_bucket
from weightsync.bus.plan import BucketPlan
from weightsync.v1 import rollout_pb2

S = rollout_pb2


class StagedApply(ApplyStrategy):
    mode = "staged"

    def __init__(self, host: SyncHost):
        super().__init__(host)
        self._holding = False  # the commit holds the engine gate (guarded by host.state_lock)
        #: (layout digest, bucket index) whose tensors a commit wrote byte for byte into parameters
        #: of their exact layout: a delta bucket of these may be staged as its changed words
        self._exact: set[tuple[str, int]] = set()

    def consume(
        self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor, sender_checksum: int | None, defer_check: bool
    ) -> tuple[object, bool]:
        ours, deferred = None, False
        if p.manifest.checksum_algo and p.dequantizer is None:
            ours = self._stage_sparse(p, plan, buf, sender_checksum)
            if ours is not None:
                return ours, False
        with p.lock:
            p.staged_plans.append(plan)
        if p.manifest.checksum_algo:
            keep = self.host.delta_base.sums_keeper(p.manifest.sync_id, plan.index, buf)
            flat, ours = copy_bucket(plan, buf, wait=not defer_check, sums_to=keep)
            if defer_check:
                p.defer(plan.index, ours, sender_checksum)
                deferred = True
            else:
                verify(plan.index, ours, sender_checksum)
            staged = dict(unpack_bucket(plan, flat))  # views of this sync's own copy
            if p.dequantizer is not None:
                with p.lock:
                    p.staged_flats[plan.index] = flat  # FP8: written from here at commit, one launch
        else:
            staged = {name: view.clone() for name, view in unpack_bucket(plan, buf)}
        with p.lock:
            p.staging.update(staged)
        return ours, deferred

    def _stage_sparse(
        self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor, sender_checksum: int | None
    ) -> int | None:
        """Stage a delta bucket as its changed words, checked first from the copy's sums: its
        checksum, or None (nothing staged) when it is not a delta bucket or the engine does not
        hold the base copy's bytes."""
        sync_id = p.manifest.sync_id
        base = self.host.delta_base
        patch = base.patch(sync_id, plan.index)  # taken either way: what the delta wrote is kept until then
        if patch is None or (p.manifest.layout_digest, plan.index) not in self._exact or not base.sparse_ok(sync_id):
            return None
        applied, ours = patch
        verify(plan.index, ours, sender_checksum)
        words = slot_words(plan, p.manifest.layout_digest, applied, buf)
        if words is None:
            return None
        with p.lock:
            p.sparse.append((plan, words, applied.word, buf, ours))
        return ours

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
        sparse, whole = [], []
        for plan, words, word, buf, ours in p.sparse:
            params = engine.writable_params([slot.meta for slot in plan.slots])
            if writable(params):
                sparse.append((plan, words, word, params))
            else:  # no longer offered: the whole bucket from the base copy (this sync's until the next prepare)
                flat, copied = copy_bucket(plan, buf)
                verify(plan.index, copied, ours)
                whole.extend(unpack_bucket(plan, flat))
        staging = self._write_fp8(p) if p.staged_flats else p.staging
        engine.load_weights(p.loadable([*staging.items(), *whole]))
        for plan, words, word, params in sparse:
            write(words, params, word)
            self.host.delta_base.engine_wrote(p.manifest.sync_id, plan.index, params)
        p.check_complete()
        engine.flush_cache()
        self._note_exact(p)

    def _write_fp8(self, p: PendingSync) -> dict:
        """Every staged block-FP8 bucket written into the engine's parameters by one launch each
        (fp8_fused_write.py), in bucket order (a scale may come a bucket before its weight); their
        checksums were checked before commit got here, so the sums of this pass are not needed.
        Returns what is left for load_weights: the buckets that could not go that way, with the
        scales this pass kept for their weights."""
        left = dict(p.staging)
        for plan in sorted(p.staged_plans, key=lambda b: b.index):
            flat = p.staged_flats.get(plan.index)
            if flat is None:
                continue
            if fp8_fused_write.write(self.fp8, self.host.engine, p, plan, flat, wait=False) is not None:
                for slot in plan.slots:
                    left.pop(slot.meta.name, None)
            else:
                left.update(fp8_fused_write.held_scales(self.fp8, p, plan))
        return left

    def _note_exact(self, p: PendingSync) -> None:
        """Which buckets load_weights wrote byte for byte: checked, unquantized, into parameters of
        their exact dtype and layout (a same-dtype copy)."""
        if p.dequantizer is not None or not p.manifest.checksum_algo:
            return
        engine, digest = self.host.engine, p.manifest.layout_digest
        for plan in p.staged_plans:
            params = engine.writable_params([slot.meta for slot in plan.slots])
            if writable(params):
                self._exact.add((digest, plan.index))
                self.host.delta_base.engine_wrote(p.manifest.sync_id, plan.index, params)
            else:
                self._exact.discard((digest, plan.index))
        if len(self._exact) > 1 << 16:  # layouts change rarely
            self._exact.clear()

    def release(self) -> None:
        if self._holding:
            self._holding = False
            self.host.engine_lock.release()
