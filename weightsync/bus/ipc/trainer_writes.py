"""Colocated CUDA IPC in the other direction: the trainer writes every bucket into the engine.

Rollout-reads (the default elsewhere) costs two processes' GPU work per byte on one GPU: the rollout
copies each bucket out of the trainer's shared buffer, and the trainer reads the same bytes once more
for the bucket checksum (ws-sum64-v1). The two processes are separate CUDA contexts, time-sliced, so
their work adds up. Here one process touches the bytes once: a rollout in `inplace` apply mode whose
engine offers its parameters (`writable_params`) shares, at PrepareSync, CUDA IPC handles of the
parameters' storage plus where each manifest tensor lies in them (`IpcDestinations`, once per layout:
later prepares name the table by id). The trainer validates every entry against its manifest, maps
each allocation once, and its stream phase is one fused copy-and-checksum launch per packed bucket
(weightsync/bus/copy/verified_copy.py `copy_into`, the kernel the rollout runs in the other direction); the
actor's own in-place buckets are all queued at once, without waits between them (`copy_all_into`),
straight into the engine's parameters. It synchronizes its stream, then commits with the sums of what
that kernel read; the rollout (paused since its prepare, STALE if the sync aborts) records them as
the version's checksums.

Guarantee, on this path only (docs/architecture.md, "Trainer writes"): the checksums are computed by
the kernel that writes the destination, from the words it reads from the trainer's bucket, on the
one GPU, into destinations validated at prepare (every manifest tensor, its dtype, shape and size,
inside its allocation); the independent second read is gone on this path only. Still caught: a
table that does not match the manifest or overruns an allocation (prepare fails, naming the tensor);
a trainer that fails or dies mid-write (the rollout is STALE from its prepare on and never serves a
half-written version); a divergence between this rollout's copy and any other copy of the version
(the sums are exactly the values a TCP, NCCL or rollout-reads sync of the same export computes, so
`weights_checksum` compares across paths). No longer caught: a corruption between the kernel's read
and its write (the same registers; no second process re-reads the bytes after they landed), and a
write into the parameters by something else in the engine's process during the sync (generation is
paused, but nothing re-reads the destination). An operator keeps
the independent second read with `ipc_direction: rollout_reads`.

A quantized manifest (block FP8 into the built-in engine, which dequantizes) is written the same way
with a writer the publisher hands the session (`QuantizedWrites`: the bus imports no format;
weightsync/formats/fp8/trainer_writes.py): the table covers the tensors as the engine holds them
(`check`'s `allowed`: an FP8 weight as its 16- or 32-bit parameter, no scale), and the writer's stream
dequantizes every weight into it with the same sums.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from weightsync.bus import dtypes
from weightsync.bus.channel import BucketSender
from weightsync.bus.plan import BucketPlan, Manifest, TensorMeta
from weightsync.v1 import bus_pb2

DIRECTIONS = ("auto", "rollout_reads", "trainer_writes")


class DestinationError(ValueError):
    """A rollout's destination table does not match the manifest (names the tensor and the field)."""


# ---- the rollout's side: what it offers -----------------------------------------------------------------
def offer(
    manifest: Manifest,
    params: Sequence[torch.Tensor],
    share_storage: Callable[[torch.Tensor], bus_pb2.CudaIpcHandle],
    wanted: Sequence[TensorMeta | None] | None = None,
) -> bus_pb2.IpcDestinations:
    """The destination table of `manifest`'s tensors (in slot order over its buckets), which live in
    `params` (one per tensor with a destination, each the exact tensor: contiguous, its dtype and
    shape): each distinct storage shared once by `share_storage` (a flat uint8 tensor of the whole
    storage -> handle). `wanted`: per slot, the tensor the engine takes (None: none, a block scale
    whose weight the trainer writes dequantized); default the slots' own."""
    metas = [m for m in (wanted if wanted is not None else slot_metas(manifest)) if m is not None]
    if len(params) != len(metas):
        raise DestinationError(f"{len(params)} parameters for the manifest's {len(metas)} tensors")
    out = bus_pb2.IpcDestinations()
    index: dict[int, int] = {}  # storage address -> allocation index
    for meta, p in zip(metas, params):
        if not p.is_contiguous() or tuple(p.shape) != tuple(meta.shape) or p.dtype != meta.dtype:
            raise DestinationError(
                f"tensor {meta.name}: the engine's parameter is {p.dtype} {list(p.shape)}"
                f"{'' if p.is_contiguous() else ' (not contiguous)'}, "
                f"the manifest sends {meta.dtype} {list(meta.shape)}"
            )
        storage = p.untyped_storage()
        key = storage.data_ptr()
        a = index.get(key)
        if a is None:
            whole = torch.empty(0, dtype=torch.uint8, device=p.device).set_(storage)
            a = index[key] = len(out.allocations)
            out.allocations.append(share_storage(whole))
        out.tensors.add(
            name=meta.name,
            allocation=a,
            offset=p.storage_offset() * p.element_size(),
            nbytes=meta.nbytes,
            dtype=dtypes.to_wire(meta.dtype),
            shape=list(meta.shape),
        )
    return out


def slot_metas(manifest: Manifest) -> list[TensorMeta]:
    """Every tensor of `manifest`, in slot order over its buckets."""
    return [slot.meta for plan in manifest.buckets for slot in plan.slots]


def layout_id(manifest: Manifest, params: Sequence[torch.Tensor]) -> str:
    """What a destination table covers: the manifest's layout and every parameter's address. The
    rollout adds a fresh token to each table it builds (receiver.py): equal addresses in a restarted
    process are other memory, which the trainer must map anew."""
    h = hashlib.sha256(manifest.layout_digest.encode())
    for p in params:
        h.update(p.data_ptr().to_bytes(8, "little"))
        h.update(str(p.device).encode())
    return h.hexdigest()[:32]


# ---- the trainer's side: validate, map, write -----------------------------------------------------------
class Destinations:
    """A rollout's destination table, validated against a manifest and mapped into this process:
    per bucket, one view per slot (where that tensor's bytes go): flat uint8, or with `allowed` (a
    quantized manifest, `check`) the engine's tensor in its dtype and shape, None for a slot that
    has no destination."""

    def __init__(
        self,
        manifest: Manifest,
        table: bus_pb2.IpcDestinations,
        open_fn: Callable[[bus_pb2.CudaIpcHandle], torch.Tensor],
        allowed: Sequence[tuple[torch.dtype, ...]] | None = None,
    ):
        check(manifest, table, allowed)
        self.digest = manifest.layout_digest
        self.maps = [open_fn(h) for h in table.allocations]  # each allocation once; unmapped when dropped
        for i, (m, h) in enumerate(zip(self.maps, table.allocations)):
            if m.numel() < h.storage_size:
                raise DestinationError(f"allocation {i}: mapped {m.numel()} bytes of its {h.storage_size}")
        by_name = {t.name: t for t in table.tensors}
        #: what verified_copy.copy_all_into checked and built for these views, kept from sync to sync
        self.prepared: dict = {}
        #: what a quantized manifest's writer built for these views (QuantizedWrites.sender), kept likewise
        self.writer_state: dict = {}
        self.buckets: list[list[torch.Tensor]] = []
        #: the logical views (a quantized manifest): each bucket's tensors as the engine holds them
        self.logical = allowed is not None
        for plan in manifest.buckets:
            views: list = []
            for slot in plan.slots:
                t = by_name.get(slot.meta.name)
                if t is None:  # no destination (check allowed none)
                    views.append(None)
                    continue
                raw = self.maps[t.allocation][t.offset : t.offset + t.nbytes]
                if self.logical:
                    raw = raw.view(dtypes.from_wire(t.dtype)).view(tuple(t.shape))
                views.append(raw)
            self.buckets.append(views)


def check(
    manifest: Manifest, table: bus_pb2.IpcDestinations, allowed: Sequence[tuple[torch.dtype, ...]] | None = None
) -> None:
    """DestinationError naming the first tensor whose entry does not match the manifest exactly
    (missing, duplicated, unknown, another dtype, shape or size, outside its allocation, not on a
    4-byte boundary: the kernel writes 32-bit words).

    `allowed` (a quantized manifest, as the trainer's writer for it says): per slot, the dtypes its
    destination may have, its shape the slot's (a block-FP8 weight is written dequantized into a
    16- or 32-bit parameter); () for a slot that must have none (its block scale). Default: the
    slot's own dtype."""
    seen: dict[str, bus_pb2.IpcDestTensor] = {}
    for t in table.tensors:
        if t.name in seen:
            raise DestinationError(f"tensor {t.name}: two destinations in the rollout's table")
        seen[t.name] = t
    n_alloc = len(table.allocations)
    metas = slot_metas(manifest)
    if allowed is not None and len(allowed) != len(metas):
        raise ValueError(f"{len(allowed)} allowed dtype sets for the manifest's {len(metas)} tensors")
    for i, m in enumerate(metas):
        ok = (m.dtype,) if allowed is None else tuple(allowed[i])
        t = seen.pop(m.name, None)
        if not ok:
            if t is not None:
                raise DestinationError(
                    f"tensor {m.name}: has a destination in the rollout's table, but the trainer writes "
                    "nothing of it into the engine (a block scale: its weight is written dequantized)"
                )
            continue
        if t is None:
            raise DestinationError(f"tensor {m.name}: the rollout's destination table lacks it")
        try:
            dtype = dtypes.from_wire(t.dtype)
        except ValueError:
            dtype = None
        if dtype not in ok:
            if allowed is None or ok == (m.dtype,):
                raise DestinationError(f"tensor {m.name}: destination dtype {dtype} != manifest's {m.dtype}")
            raise DestinationError(
                f"tensor {m.name}: destination dtype {dtype}; the trainer writes this {m.dtype} weight "
                f"dequantized into {' or '.join(str(d) for d in ok)}"
            )
        if tuple(t.shape) != tuple(m.shape):
            raise DestinationError(f"tensor {m.name}: destination shape {list(t.shape)} != manifest's {list(m.shape)}")
        if dtype == m.dtype and t.nbytes != m.nbytes:
            raise DestinationError(f"tensor {m.name}: destination nbytes {t.nbytes} != manifest's {m.nbytes}")
        if dtype != m.dtype and t.nbytes != math.prod(m.shape) * dtype.itemsize:
            raise DestinationError(
                f"tensor {m.name}: destination nbytes {t.nbytes} != {math.prod(m.shape) * dtype.itemsize} "
                f"({dtype} {list(m.shape)})"
            )
        if t.allocation >= n_alloc:
            raise DestinationError(
                f"tensor {m.name}: allocation {t.allocation} out of range (the table shares {n_alloc})"
            )
        size = table.allocations[t.allocation].storage_size
        if t.offset + t.nbytes > size:
            raise DestinationError(
                f"tensor {m.name}: bytes [{t.offset}, {t.offset + t.nbytes}) run past its allocation's {size}"
            )
        if t.offset % 4:
            raise DestinationError(f"tensor {m.name}: offset {t.offset} is not on a 4-byte boundary")
    if seen:
        extra = sorted(seen)
        raise DestinationError(f"tensor {extra[0]}: in the rollout's destination table but not in the manifest")


class QuantizedWrites(Protocol):
    """How the trainer writes a quantized manifest into an engine that takes it dequantized (block FP8:
    weightsync/formats/fp8/trainer_writes.py; the bus imports no format). The publisher hands one to
    the sync's session (`use_quantized_writes`); without it a quantized sync is never written this way."""

    def destination_dtypes(self, manifest: Manifest) -> list[tuple[torch.dtype, ...]]:
        """Per slot (in order over the buckets), the dtypes its destination may have ((): none);
        ValueError naming the tensor for a manifest it cannot write."""
        ...

    def sender(self, dests: Destinations, rid: str, manifest: Manifest) -> TrainerWriteSender:
        """The stream of one sync into `dests` (validated with `destination_dtypes`)."""
        ...


def choose(direction: str, targets: int, offered: bool) -> str:
    """The direction a sync runs: trainer_writes only for one target that offered a table and a
    trainer not set to rollout_reads; ValueError for trainer_writes that cannot run."""
    if direction not in DIRECTIONS:
        raise ValueError(f"ipc_direction={direction!r} must be {', '.join(DIRECTIONS)}")
    if direction == "rollout_reads" or targets != 1:
        return "rollout_reads"
    if offered:
        return "trainer_writes"
    return "rollout_reads"


class TrainerWriteSender(BucketSender):
    """The stream of a trainer-writes sync: each bucket copied into the engine's parameters by one
    fused copy-and-checksum launch (the actor's own buckets: all queued at once, `send_held`).
    `flush` synchronizes the stream and reads every sum; the commit carries them (no bucket travels
    to the rollout, nor any per-bucket message)."""

    releases_previous = True  # a packed buffer is reusable once the launch after it has been queued
    checksums_in_band = "none"
    computes_checksums = True

    def __init__(self, dests: Destinations, rid: str):
        self.dests, self.rid = dests, rid
        self._pending: list = []
        self._events: list = []
        self._values: list[int] = []
        #: parts of the write pass (the sync's stream.trainer_writes.*): `queue` the host time to queue
        #: the launches, `wait` the stream synchronize after them, `read` the one read of the sums
        self.phase_seconds: dict[str, float] = {}

    def send(self, plan: BucketPlan, buf: torch.Tensor, checksum: int | None) -> None:
        pending = self._write(plan, buf)
        self._pending.append(pending)
        self._events.append(pending.ready)
        if len(self._events) > 1 and self._events[-2] is not None:
            # bucket k-1's buffer may be refilled once send(k) returns: its read must be done (bucket
            # k's launch is already queued behind it, so the GPU does not idle meanwhile)
            self._events[-2].synchronize()

    def _write(self, plan: BucketPlan, buf: torch.Tensor):
        """Bucket `plan` from `buf` into the engine: its PendingChecksum (queued, not waited for)."""
        from weightsync.bus.copy.verified_copy import copy_into

        pending = copy_into(plan, buf, self.dests.buckets[plan.index], wait=False)
        if pending is None:
            raise DestinationError(f"bucket {plan.index}: the engine's parameters cannot take it as words")
        return pending

    def send_held(self, plans, bufs) -> bool:
        """The actor's own buckets: every one written by its fused launch, all queued on the current
        stream behind the actor's own writes (no host synchronize first, no wait between buckets)."""
        from weightsync.bus.copy.verified_copy import copy_all_into

        t0 = time.perf_counter()
        pending = copy_all_into(plans, bufs, [self.dests.buckets[p.index] for p in plans], prepared=self.dests.prepared)
        if pending is None:
            raise DestinationError("the engine's parameters cannot take the buckets as words")
        self._pending = pending
        self.phase_seconds["queue"] = time.perf_counter() - t0
        return True

    def flush(self) -> None:
        from weightsync.bus.copy.verified_copy import pending_values

        t0 = time.perf_counter()
        if self._pending and self._pending[0].ready is not None:
            dev = self.dests.maps[0].device if self.dests.maps else None
            torch.cuda.current_stream(dev).synchronize()  # every byte landed before the commit says so
        t1 = time.perf_counter()
        self._values = pending_values(self._pending)
        self.phase_seconds["wait"] = t1 - t0
        self.phase_seconds["read"] = time.perf_counter() - t1
        self._check_written()

    def _check_written(self) -> None:
        """After the writes landed: raise if what was written may not be committed (a subclass's)."""

    def checksums(self) -> list[int]:
        return list(self._values)

    def commit_on_stream(self, rollout_ids) -> None:
        pass  # no stream: the commit goes as CommitSync (or on the sync link)

    def commit_elsewhere(self, rollout_ids) -> None:
        pass
