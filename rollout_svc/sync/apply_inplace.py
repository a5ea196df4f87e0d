"""In-place apply: the engine gate is taken at a sync's first bucket and buckets are loaded as they
arrive (generation paused, no extra memory).

An abort after the first bucket leaves the engine STALE: generation is refused until a complete
sync commits. A sync's first bucket is checked before the engine is touched, so a bad first bucket
still leaves the old version serving. Where the engine offers its parameters (`writable_params`),
a bucket is copied straight into them and that copy is its checksum pass
(weightsync/bus/copy/verified_copy.py); the check then runs after the write, and a mismatch aborts the
sync with the engine STALE.

SGLang offers its parameters this way too once its worker exported their table and rollout-svc mapped it
(rollout_svc/engine/sglang_mapped.py): NCCL and TCP buckets are then written here, in this process's CUDA context.

A block-FP8 bucket for an engine that dequantizes goes the same way where the engine offers its
parameters: one launch dequantizes it into them and sums what it reads (fp8_fused_write.py), checked
after the write as above.

An engine whose weights live in other processes may load a bucket with a copy of its own that is also the
checksum pass (`load_bucket_summed`: SGLang's TP workers, rollout_svc/engine/sglang_direct.py); that
bucket too is checked after the write. Buckets the sender holds until the commit are queued there
(`queue_bucket_summed`) and written together when the commit reads their checksums; the first bucket too,
once its own early check passed (one engine call per sync).

A delta bucket (rollout_svc/sync/delta_base.py) is checked before it touches the engine, from the
base copy's word sums; where the engine holds exactly the base copy's bytes, only the words the
delta changed are then written (sparse_write.py), and otherwise the whole bucket as above.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time

import torch

from rollout_svc.sync import fp8_fused_write
from rollout_svc.sync.apply import ApplyStrategy, SyncHost
from rollout_svc.sync.pending import TIMED_OUT, PendingSync, verify
from rollout_svc.sync.sparse_write import slot_words, writable, write
from weightsync.bus.copy.checksum import from_sums, word_sums
from weightsync.bus.copy.verified_copy import copy_into
from weightsync.bus.errors import SyncError
from weightsync.bus.pack import unpack_bucket
from weightsync.bus.plan import BucketPlan
from weightsync.v1 import rollout_pb2

S = rollout_pb2


class InPlaceApply(ApplyStrategy):
    mode = "inplace"

    def __init__(self, host: SyncHost):
        super().__init__(host)
        self._holding = False  # the sync holds the engine gate since its first bucket (host.state_lock)
        self._pausing = threading.Lock()  # one sender thread waits to pause generation at a time

    def consume(
        self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor, sender_checksum: int | None, defer_check: bool
    ) -> tuple[object, bool]:
        checked = bool(p.manifest.checksum_algo)
        ours = None
        patch = self._patch(p, plan) if checked else None
        if patch is not None:  # a delta bucket: checked from the copy's sums, before the engine is touched
            ours = patch[1]
            verify(plan.index, ours, sender_checksum)
        elif checked and not p.applied_any:
            ours = _checksum(buf[: plan.nbytes], self._keeper(p, plan, buf))
            verify(plan.index, ours, sender_checksum)
        with self._writing(p):
            if patch is not None and self._write_sparse(p, plan, buf, patch[0]):
                return ours, False
            copied, deferred = (
                self._write_direct(p, plan, buf, sender_checksum, defer_check) if checked else (None, False)
            )
            if copied is None and checked and ours is None and p.dequantizer is None:
                copied, deferred = self._load_summed(p, plan, buf, sender_checksum, defer_check)
            if copied is None:
                if checked and ours is None:
                    ours = _checksum(buf[: plan.nbytes], self._keeper(p, plan, buf))
                    verify(plan.index, ours, sender_checksum)
                elif defer_check and self._queue_checked(p, plan, buf, sender_checksum):
                    return ours, True
                self._load(p, plan, buf)
            elif ours is None:  # the first bucket keeps the sum checked before the write
                ours = copied
        return ours, deferred

    def _keeper(self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor):
        return self.host.delta_base.sums_keeper(p.manifest.sync_id, plan.index, buf)

    def _patch(self, p: PendingSync, plan: BucketPlan):
        """(what the delta wrote, the resulting bucket's checksum) for a delta bucket onto a copy
        with known sums, else None."""
        if p.dequantizer is not None:
            return None
        return self.host.delta_base.patch(p.manifest.sync_id, plan.index)

    def _write_sparse(self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor, applied) -> bool:
        """Write only the words the delta changed, where the engine holds exactly the base copy's
        bytes in parameters of the bucket's layout; False (nothing written) otherwise."""
        base = self.host.delta_base
        if not base.sparse_ok(p.manifest.sync_id):
            return False
        params = self.host.engine.writable_params([slot.meta for slot in plan.slots])
        if not writable(params):
            return False
        words = slot_words(plan, p.manifest.layout_digest, applied, buf)
        if words is None:
            return False
        write(words, params, applied.word)
        base.engine_wrote(p.manifest.sync_id, plan.index, params)
        return True

    def _write_direct(
        self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor, sender_checksum: int | None, defer_check: bool
    ) -> tuple[object, bool]:
        """Copy the bucket byte for byte into the engine's parameters, checksumming as it copies:
        (the copy's checksum, whether it was deferred), or (None, False) when the parameters cannot
        take it as it is (the engine then loads it). Already in the parameters when the check runs:
        a mismatch aborts the sync, and since buckets were applied the engine is STALE."""
        if p.dequantizer is not None:
            return self._write_fp8(p, plan, buf, sender_checksum, defer_check)
        params = self.host.engine.writable_params([slot.meta for slot in plan.slots])
        if params is None:
            return None, False
        copied = copy_into(plan, buf, params, wait=not defer_check, sums_to=self._keeper(p, plan, buf))
        if copied is None:  # declined (a parameter not laid out for it)
            return None, False
        # byte for byte, and the sync commits only once its checksum matched
        self.host.delta_base.engine_wrote(p.manifest.sync_id, plan.index, params)
        if defer_check:
            p.defer(plan.index, copied, sender_checksum)
            return copied, True
        verify(plan.index, copied, sender_checksum)
        return copied, False

    def _load_summed(
        self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor, sender_checksum: int | None, defer_check: bool
    ) -> tuple[object, bool]:
        """An engine whose own copy is the checksum pass (SGLang's workers): (its checksum, whether deferred),
        checked after the write; (None, False) when it cannot take the bucket that way. A bucket the sender holds
        until the commit may be queued and written with others when the commit reads its checksum. The delta
        base keeps no word sums of such a bucket: a later delta onto it is checked in full."""
        engine = self.host.engine
        if defer_check:
            pending = engine.queue_bucket_summed(plan, buf)
            if pending is not None:
                p.defer(plan.index, pending, sender_checksum)
                return pending, True
        copied = engine.load_bucket_summed(plan, buf)
        if copied is not None:
            verify(plan.index, copied, sender_checksum)
        return copied, False

    def _queue_checked(self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor, sender_checksum: int | None) -> bool:
        """The first bucket, already checked before the engine was touched: an engine that writes the buckets held
        until the commit together (SGLang: one call for all) takes it with them; False: not queued."""
        if p.dequantizer is not None:
            return False
        pending = self.host.engine.queue_bucket_summed(plan, buf)
        if pending is None:
            return False
        p.defer(plan.index, pending, sender_checksum)  # and its engine-side sums checked at commit, as the others'
        return True

    def _write_fp8(
        self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor, sender_checksum: int | None, defer_check: bool
    ) -> tuple[object, bool]:
        """A block-FP8 bucket dequantized into the engine's parameters by one launch that also sums
        what it reads (fp8_fused_write.py): (its checksum, whether deferred), or (None, False) when it
        cannot go that way. The same contract as a bf16 bucket's direct write: checked after it."""
        copied = fp8_fused_write.write(
            self.fp8, self.host.engine, p, plan, buf, wait=not defer_check, sums_to=self._keeper(p, plan, buf)
        )
        if copied is None:
            return None, False
        if defer_check:
            p.defer(plan.index, copied, sender_checksum)
            return copied, True
        verify(plan.index, copied, sender_checksum)
        return copied, False

    def hold_for_writes(self, p: PendingSync) -> None:
        """Pause generation for a sync the trainer writes into the engine itself (no bucket comes
        here); from now on the engine counts as written (an abort: STALE)."""
        with self._writing(p):
            p.trainer_writes = True

    @contextlib.contextmanager
    def _writing(self, p: PendingSync):
        """The engine paused for `p`, then the state lock held while the caller writes: an abort
        (timer, AbortSync, a superseding prepare) cannot release the engine gate between the check
        and the write, and nothing of an aborted sync is written after the abort (or into the next
        sync's weights). From here on the engine counts as written (an abort: STALE)."""
        if not self._holding:
            self._pause_engine(p)
        with self.host.state_lock:
            if self.host.left_behind(p):
                raise SyncError(f"sync {p.manifest.sync_id} was aborted: {p.error or 'superseded'}")
            p.applied_any = True
            yield

    def _load(self, p: PendingSync, plan: BucketPlan, buf: torch.Tensor) -> None:
        engine = self.host.engine
        if p.dequantizer is None:
            engine.load_bucket(plan, buf)
        else:
            # with the scales the fused write kept for this bucket's weights, if an earlier bucket took it
            engine.load_weights(
                p.loadable([*fp8_fused_write.held_scales(self.fp8, p, plan), *unpack_bucket(plan, buf)])
            )

    def _pause_engine(self, p: PendingSync) -> None:
        """Take the engine for the rest of the sync before its first bucket is loaded.

        The wait for running generations happens outside the state lock, so an abort or a newer
        prepare is answered at once and ends it (nothing was loaded yet: the old version serves);
        with several senders, one thread waits and the others wait for it."""
        host = self.host
        gone = functools.partial(host.left_behind, p)
        if not self._pausing.acquire(timeout=max(0.0, p.deadline - time.monotonic())):
            raise SyncError("could not pause generation before the sync deadline", "DEADLINE_EXCEEDED")
        try:
            if self._holding:
                return  # another sender's thread paused it meanwhile
            got = host.engine_lock.acquire(timeout=max(0.0, p.deadline - time.monotonic()), give_up=gone)
            with host.state_lock:
                if got and gone():
                    host.engine_lock.release()
                if gone() and p.error != TIMED_OUT:
                    raise SyncError(
                        f"sync {p.manifest.sync_id} was aborted while it waited to pause generation: "
                        f"{p.error or 'superseded'}"
                    )
                if not got or gone():  # the deadline passed (our wait's or the sync's timer)
                    raise SyncError("could not pause generation before the sync deadline", "DEADLINE_EXCEEDED")
                self._holding = True
                host.state = S.APPLYING
                host.engine.begin_apply()
        finally:
            self._pausing.release()

    def apply(self, p: PendingSync) -> None:
        p.check_complete()
        self.host.engine.end_apply()

    def release(self) -> None:
        if self._holding:
            self._holding = False
            self.host.engine_lock.release()


def _checksum(buf: torch.Tensor, keep) -> int:
    """checksum.bucket_checksum of `buf`, its word sums handed to `keep` (the delta base's, or None)."""
    n = buf.numel()
    whole = n - n % 4
    sums = word_sums(buf[:whole].view(torch.int32))
    if keep is not None:
        keep(sums)
    return from_sums(sums, buf[whole:], n)
