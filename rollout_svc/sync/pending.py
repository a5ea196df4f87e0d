"""The bookkeeping of one prepared sync: which buckets each sender still owes, their checksums, and
the copies whose checksums are read at commit.

A sync may have several senders (trainer ranks each streaming the buckets of the tensors they own;
`BucketSpec.sender`), each on its own connection and thread: every field written by more than one
of them is guarded by `lock`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from weightsync.bus.copy.verified_copy import PendingChecksum, pending_values
from weightsync.bus.errors import SyncError
from weightsync.bus.plan import Manifest

#: the reason the sync's own timer gives when it aborts a sync
TIMED_OUT = "timed out before commit"


def verify(index: int, ours: int | None, sender_checksum: int | None) -> None:
    """SyncError DATA_LOSS when bucket `index`'s checksum differs from the sender's (both known)."""
    if sender_checksum is not None and ours is not None and ours != sender_checksum:
        raise SyncError(
            f"bucket {index}: checksum {ours:#x} != sender's {sender_checksum:#x} (corrupted in transit)", "DATA_LOSS"
        )


@dataclass
class PendingSync:
    manifest: Manifest
    deadline: float
    #: bucket index -> our checksum (a PendingChecksum until commit reads it, for deferred checks)
    received: dict[int, object] = field(default_factory=dict)
    #: staged apply: the received tensors, views of this sync's own copies, loaded at commit
    staging: dict[str, torch.Tensor] = field(default_factory=dict)
    applied_any: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    dequantizer: object = None  # weightsync.formats.fp8.receive.Dequantizer for quantized syncs, else None
    #: quantized syncs: the weights whose scales the fused FP8 write holds (fp8_fused_write.py), set at its first bucket
    fp8_held: set | None = None
    #: staged apply: bucket index -> this sync's checked copy of the bucket (the FP8 buckets, written at commit)
    staged_flats: dict = field(default_factory=dict)
    #: bucket index -> (our checksum still on the GPU, the sender's), until commit reads it
    deferred: dict[int, tuple] = field(default_factory=dict)
    # per sender: its buckets in sending order, and how many of them arrived
    order: dict[int, list[int]] = field(default_factory=dict)
    arrived: dict[int, int] = field(default_factory=dict)
    connected: set[int] = field(default_factory=set)  # senders that opened their stream
    lock: threading.Lock = field(default_factory=threading.Lock)  # bookkeeping of concurrent senders
    committing: bool = False  # a commit passed its checks (it may still wait for the engine)
    #: the trainer writes every bucket into the engine itself (CUDA IPC, trainer_writes): no bucket
    #: arrives here, and the commit's checksums are those of what it wrote
    trainer_writes: bool = False
    #: staged apply: the buckets staged whole, and the delta buckets kept as their changed words
    #: alone (plan, sparse_write.SlotWords list, word bytes, the base copy's bucket, its checksum), written
    #: at commit
    staged_plans: list = field(default_factory=list)
    sparse: list = field(default_factory=list)

    def trainer_wrote(self, checksums: dict[int, int]) -> None:
        """At commit of a trainer-writes sync: every bucket is in, with the trainer's checksums."""
        with self.lock:
            self.received = {i: checksums.get(i) for i in range(len(self.manifest.buckets))}
            self.arrived = {s: len(o) for s, o in self.order.items()}
            self.done.set()

    def __post_init__(self) -> None:
        # the layout's, computed once per layout (Manifest.sender_order): read only here
        self.order = self.manifest.sender_order
        self.arrived = dict.fromkeys(self.order, 0)

    def admit(self, index: int) -> None:
        """Bucket `index` is the next one its sender owes; raise otherwise."""
        if self.trainer_writes:
            raise SyncError(
                f"bucket {index} arrived, but the trainer writes sync {self.manifest.sync_id} into the engine "
                "itself (it was prepared so): no bucket may arrive",
                "INVALID_ARGUMENT",
            )
        sender = self.manifest.buckets[index].sender if 0 <= index < len(self.manifest.buckets) else None
        if sender is None:
            raise SyncError(
                f"bucket {index} arrived; the manifest has {len(self.manifest.buckets)} buckets", "INVALID_ARGUMENT"
            )
        with self.lock:
            k = self.arrived[sender]
            order = self.order[sender]
            if k >= len(order) or order[k] != index:
                want = order[k] if k < len(order) else "none (all arrived)"
                raise SyncError(
                    f"bucket {index} arrived from sender {sender}, expected bucket {want}", "INVALID_ARGUMENT"
                )
            self.arrived[sender] = k + 1

    def record(self, index: int, checksum: int | None) -> None:
        with self.lock:
            self.received[index] = checksum
            if len(self.received) == len(self.manifest.buckets):
                self.done.set()

    def defer(self, index: int, pending: PendingChecksum, sender_checksum: int | None) -> None:
        with self.lock:
            self.deferred[index] = (pending, sender_checksum)

    def resolve(self) -> None:
        """Read every checksum whose copy was left queued (consume_bucket's defer_check) and check
        it against the sender's; SyncError DATA_LOSS on the first mismatch."""
        with self.lock:
            deferred = sorted(self.deferred.items())
        ours = pending_values([pending for _, (pending, _) in deferred])  # one device read for all
        with self.lock:
            for (index, _), value in zip(deferred, ours):
                self.received[index] = value
                del self.deferred[index]
        for (index, (_, sender_checksum)), value in zip(deferred, ours):
            verify(index, value, sender_checksum)

    def wait_copies(self) -> None:
        """Until no queued copy reads a sender's buffer any more (before an abort lets go of it);
        from the moment a copy is deferred, even before its bucket is recorded."""
        with self.lock:
            pending = [p for p, _ in self.deferred.values()]
        for p in pending:
            p.wait()

    def checksums(self) -> list[int | None]:
        return [self.received[i] for i in range(len(self.manifest.buckets))]

    def missing(self) -> dict[int, int]:
        """sender rank -> how many of its buckets have not arrived."""
        return {s: len(o) - self.arrived[s] for s, o in self.order.items() if self.arrived[s] < len(o)}

    def loadable(self, named):
        return self.dequantizer(named) if self.dequantizer is not None else named

    def check_complete(self) -> None:
        if self.dequantizer is not None:
            self.dequantizer.check_complete()
