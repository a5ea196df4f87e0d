"""Bucket plans: where every tensor of a sync lives, decided from metadata alone.

The trainer lays tensors out in the order its exporter yields them, so it can send the plan
(the manifest) before gathering anything. The rollout validates the manifest at the boundary
(`manifest_from_proto`) before it allocates a byte.

With several senders (every trainer rank that assembles HF tensors streams its own), each tensor
has an owner rank; the buckets of one sender hold only its tensors, in its export order, and the
senders' buckets follow each other in rank order. The layout is a pure function of (metadata,
owners, bucket size), so every trainer rank computes the same manifest without talking.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
from dataclasses import dataclass, field

import torch

from weightsync.bus import dtypes
from weightsync.v1 import bus_pb2

# Offsets are aligned so every tensor view is aligned for any dtype and for vectorised copies.
ALIGN = 256
# A manifest claiming more than this is refused outright (a 1T-parameter model in fp32 is 4 TB).
MAX_TOTAL_BYTES = 8 << 40
MAX_TENSORS = 1_000_000
# A rollout accepts one data connection per sender; more than this many is not a trainer.
MAX_SENDERS = 4096


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    # Computed once: it is read several times per tensor per sync (plan, pack, validate, unpack).
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * dtypes.element_size(self.dtype))


def fast_meta(name: str, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> TensorMeta:
    """A TensorMeta whose `nbytes` the caller has checked (manifest_from_proto): the frozen dataclass's
    __init__ and __post_init__ cost over a second per 100,000 tensors of a manifest."""
    m = object.__new__(TensorMeta)
    m.__dict__.update(name=name, shape=shape, dtype=dtype, nbytes=nbytes)
    return m


@dataclass(frozen=True)
class Quantization:
    """How quantized tensors of a sync are encoded (bus.proto Quantization); the bus only carries
    it: the formats that implement a scheme live in weightsync.formats."""

    method: str
    fmt: str
    weight_block_size: tuple[int, ...]


@dataclass(frozen=True)
class Slot:
    meta: TensorMeta
    offset: int


def fast_slot(meta: TensorMeta, offset: int) -> Slot:
    """Slot(meta, offset) without the frozen dataclass's __init__ (as fast_meta)."""
    s = object.__new__(Slot)
    s.__dict__.update(meta=meta, offset=offset)
    return s


@dataclass
class BucketPlan:
    index: int
    nbytes: int = 0
    slots: list[Slot] = field(default_factory=list)
    sender: int = 0  # global trainer rank that streams this bucket

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the tensors alone (nbytes also counts the alignment gaps between them)."""
        return sum(s.meta.nbytes for s in self.slots)


@dataclass
class Manifest:
    version: int
    sync_id: str
    bucket_bytes: int
    buckets: list[BucketPlan]
    model_family: str = ""
    checksum_algo: str = ""
    origin: str = ""
    quantization: Quantization | None = None  # set when some weights travel quantized (weightsync.formats)
    #: sha256 of the layout (weightsync.bus.layout); "" when not computed
    layout_digest: str = ""

    # Computed once per manifest (a sync reads each several times, over every bucket): the buckets of
    # a manifest are never changed once it is built (plan_buckets, manifest_from_proto, ManifestCache).
    @functools.cached_property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @functools.cached_property
    def num_tensors(self) -> int:
        return sum(len(b.slots) for b in self.buckets)

    @functools.cached_property
    def tensor_bytes(self) -> int:
        """Bytes of the tensors alone (total_bytes also counts the alignment gaps between them)."""
        return sum(b.tensor_bytes for b in self.buckets)

    def metas(self) -> list[TensorMeta]:
        return [s.meta for b in self.buckets for s in b.slots]

    @property
    def senders(self) -> list[int]:
        """The trainer ranks streaming this sync, ascending."""
        return list(self._senders)

    @functools.cached_property
    def _senders(self) -> tuple[int, ...]:
        return tuple(sorted({b.sender for b in self.buckets}))

    @functools.cached_property
    def sender_order(self) -> dict[int, list[int]]:
        """sender rank -> the indices of its buckets, in sending order (shared: do not change)."""
        out: dict[int, list[int]] = {}
        for b in self.buckets:
            out.setdefault(b.sender, []).append(b.index)
        return out

    def for_sync(self, version: int, sync_id: str, origin: str) -> Manifest:
        """This layout as one sync's manifest: the buckets shared, and what was computed over them kept,
        so a steady-state sync walks none of them again."""
        out = dataclasses.replace(self, version=version, sync_id=sync_id, origin=origin)
        for name in _PER_LAYOUT:
            out.__dict__[name] = getattr(self, name)  # computed on the layout's first sync, then kept
        return out

    def buckets_of(self, sender: int) -> list[BucketPlan]:
        """The buckets `sender` streams, in the order it sends them."""
        return [b for b in self.buckets if b.sender == sender]

    def digest(self) -> str:
        """A fingerprint of the layout (names, shapes, dtypes, offsets, senders): trainer ranks that
        computed the manifest independently compare it before streaming."""
        import hashlib

        h = hashlib.sha256(f"{self.sync_id}|{self.version}|{self.bucket_bytes}".encode())
        for b in self.buckets:
            h.update(f"|{b.index}:{b.sender}:{b.nbytes}".encode())
            for s in b.slots:
                h.update(f";{s.meta.name}:{s.meta.shape}:{s.meta.dtype}:{s.offset}".encode())
        return h.hexdigest()[:32]


#: Manifest's cached properties: functions of the buckets alone, which every sync of a layout shares
_PER_LAYOUT = ("total_bytes", "num_tensors", "tensor_bytes", "_senders", "sender_order")


@contextlib.contextmanager
def bulk():
    """Around building a layout's per-tensor objects (metas, slots: hundreds of thousands, none in a
    cycle): the cyclic collector paused, then left as it was. Left on, it ran a collection every few
    hundred of them, each older one over every object alive, which more than doubled the time to
    plan or validate a 140,000-tensor manifest (bench/control_plane.py)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int, owners: list[int] | None = None) -> list[BucketPlan]:
    """Greedy, order-preserving layout. A tensor larger than `bucket_bytes` gets a bucket alone.

    `owners` (one global trainer rank per meta): each rank's tensors, in their order, fill that
    rank's own buckets; ranks follow each other in ascending order. None: one sender, rank 0.
    """
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes={bucket_bytes} is below the {ALIGN}-byte alignment; use at least 1 MiB")
    if owners is None:
        owners = [0] * len(metas)
    if len(owners) != len(metas):
        raise ValueError(f"owners has {len(owners)} entries for {len(metas)} tensors")
    seen: set[str] = set()
    by_owner: dict[int, list[TensorMeta]] = {}
    for m, owner in zip(metas, owners):
        if m.name in seen:
            raise ValueError(f"tensor {m.name} is exported twice; check the model family's rule table")
        seen.add(m.name)
        if not 0 <= owner < MAX_SENDERS:
            raise ValueError(f"tensor {m.name}: owner rank {owner} is outside [0, {MAX_SENDERS})")
        by_owner.setdefault(owner, []).append(m)
    buckets: list[BucketPlan] = []
    for sender in sorted(by_owner):
        cur = BucketPlan(index=len(buckets), sender=sender)
        for m in by_owner[sender]:
            start = _align(cur.nbytes)
            if cur.slots and start + m.nbytes > bucket_bytes:
                buckets.append(cur)
                cur = BucketPlan(index=len(buckets), sender=sender)
                start = 0
            cur.slots.append(Slot(m, start))
            cur.nbytes = start + m.nbytes
        if cur.slots:
            buckets.append(cur)
    return buckets


def make_manifest(
    metas: list[TensorMeta],
    *,
    version: int,
    sync_id: str,
    bucket_bytes: int,
    model_family: str = "",
    checksum_algo: str = "",
    origin: str = "",
    quantization: Quantization | None = None,
    owners: list[int] | None = None,
) -> Manifest:
    return Manifest(
        version=version,
        sync_id=sync_id,
        bucket_bytes=bucket_bytes,
        buckets=plan_buckets(metas, bucket_bytes, owners),
        model_family=model_family,
        checksum_algo=checksum_algo,
        origin=origin,
        quantization=quantization,
    )


def manifest_to_proto(m: Manifest) -> bus_pb2.Manifest:
    """`m` on the wire, every tensor an entry (weightsync.bus.runs writes a layer's experts as one)."""
    msg = bus_pb2.Manifest(
        version=m.version,
        sync_id=m.sync_id,
        bucket_bytes=m.bucket_bytes,
        total_bytes=m.total_bytes,
        model_family=m.model_family,
        checksum_algo=m.checksum_algo,
        origin=m.origin,
        layout_digest=m.layout_digest,
    )
    if m.quantization is not None:
        q = m.quantization
        msg.quantization.CopyFrom(
            bus_pb2.Quantization(method=q.method, fmt=q.fmt, weight_block_size=list(q.weight_block_size))
        )
    for b in m.buckets:
        pb = msg.buckets.add(index=b.index, nbytes=b.nbytes, sender=b.sender)
        for s in b.slots:
            pb.tensors.add(
                name=s.meta.name,
                dtype=dtypes.to_wire(s.meta.dtype),
                shape=list(s.meta.shape),
                offset=s.offset,
                nbytes=s.meta.nbytes,
            )
    return msg


def _field(bucket: int, tensor: int, name: str) -> str:
    return f"manifest.buckets[{bucket}].tensors[{tensor}] ({name!r})"


def _run_field(bucket: int, tensor: int, t) -> str:
    return f"manifest.buckets[{bucket}].tensors[{tensor}] (run {t.name!r}{{{t.run_first}..}})"


def _expand_run(
    t, bucket: int, tensor: int, end_prev: int, bucket_nbytes: int, names: set[str], count: int, out: list[Slot]
):
    """Validate the run entry `t` and append the slots it stands for to `out`; (end offset, count).

    One check per member covers every block (same shape, dtype and offset within each); the names are
    checked unique one by one, as a plain manifest's are.
    """
    where = _run_field(bucket, tensor, t)
    n, first, stride, base, prefix = t.run_count, t.run_first, t.run_stride, t.offset, t.name
    if not prefix or not t.run_members:
        raise ValueError(f"{where}: a run needs a name prefix and at least one member")
    if count + n * len(t.run_members) > MAX_TENSORS:
        raise ValueError(f"manifest has more than {MAX_TENSORS} tensors")
    members = []
    block_end = 0
    for mb in t.run_members:
        shape, rel, nbytes = tuple(mb.shape), mb.offset, mb.nbytes
        dt = dtypes.from_wire(mb.dtype)
        name = f"{prefix}{first}{mb.name}"  # the first block's tensor, for the error messages
        if len(shape) > 8 or (shape and min(shape) < 0):
            raise ValueError(f"{where}: member {name!r}: shape {list(shape)} is not a valid tensor shape")
        meta = TensorMeta(name, shape, dt)
        if meta.nbytes != nbytes:
            raise ValueError(
                f"{where}: member {name!r}: nbytes={nbytes} but shape {list(shape)} x {dt} needs {meta.nbytes}"
            )
        itemsize = dt.itemsize
        if rel < block_end or (base + rel) % itemsize or stride % itemsize:
            raise ValueError(f"{where}: member {name!r}: offset {rel} overlaps the previous member or is misaligned")
        block_end = rel + nbytes
        members.append((mb.name, shape, dt, rel, nbytes))
    if base < end_prev:
        raise ValueError(f"{where}: offset {base} overlaps the previous tensor")
    if n > 1 and stride < block_end:
        raise ValueError(f"{where}: run_stride={stride} is shorter than a block's {block_end} bytes (blocks overlap)")
    end = base + (n - 1) * stride + block_end
    if end > bucket_nbytes:
        raise ValueError(f"{where}: ends at byte {end}, past the bucket's {bucket_nbytes} bytes")
    add, append, new = names.add, out.append, object.__new__
    for k in range(n):
        index, at = str(first + k), base + k * stride
        for suffix, shape, dt, rel, nbytes in members:
            name = prefix + index + suffix
            if name in names:
                raise ValueError(f"{where}: tensor {name!r} is named twice in the manifest")
            add(name)
            # plan.fast_meta and fast_slot, inlined: this runs for every tensor of a run
            meta = new(TensorMeta)
            d = meta.__dict__
            d["name"], d["shape"], d["dtype"], d["nbytes"] = name, shape, dt, nbytes
            slot = new(Slot)
            d = slot.__dict__
            d["meta"], d["offset"] = meta, at + rel
            append(slot)
    return end, count + n * len(members)


def manifest_from_proto(msg: bus_pb2.Manifest, *, max_total_bytes: int = MAX_TOTAL_BYTES) -> Manifest:
    """Validate a manifest received from the network; every error names the offending field."""
    if not msg.sync_id:
        raise ValueError("manifest.sync_id is empty")
    if msg.total_bytes > max_total_bytes:
        raise ValueError(f"manifest.total_bytes={msg.total_bytes} exceeds the limit {max_total_bytes}")
    buckets: list[BucketPlan] = []
    names: set[str] = set()
    total = 0
    count = 0
    for i, pb in enumerate(msg.buckets):
        if pb.index != i:
            raise ValueError(f"manifest.buckets[{i}].index={pb.index}, expected {i}")
        if pb.nbytes > max_total_bytes:
            raise ValueError(f"manifest.buckets[{i}].nbytes={pb.nbytes} exceeds the limit {max_total_bytes}")
        if pb.sender >= MAX_SENDERS:
            raise ValueError(f"manifest.buckets[{i}].sender={pb.sender} exceeds the limit {MAX_SENDERS - 1}")
        plan = BucketPlan(index=i, nbytes=pb.nbytes, sender=pb.sender)
        end_prev = 0
        # Each field is read once (protobuf accessors are not free) and the error text is built
        # only on failure: this runs for every tensor of every PrepareSync.
        at_start = count
        for j, t in enumerate(pb.tensors):
            if t.run_count:  # a run of alike blocks (weightsync.bus.runs)
                end_prev, count = _expand_run(t, i, j, end_prev, pb.nbytes, names, count, plan.slots)
                continue
            name, shape, offset, nbytes = t.name, tuple(t.shape), t.offset, t.nbytes
            count += 1
            if count > MAX_TENSORS:
                raise ValueError(f"manifest has more than {MAX_TENSORS} tensors")
            if not name or name in names:
                raise ValueError(f"{_field(i, j, name)}: name is empty or repeated")
            names.add(name)
            dt = dtypes.from_wire(t.dtype)
            if len(shape) > 8 or (shape and min(shape) < 0):
                raise ValueError(f"{_field(i, j, name)}: shape {list(shape)} is not a valid tensor shape")
            meta = fast_meta(name, shape, dt, math.prod(shape) * dt.itemsize)
            if meta.nbytes != nbytes:
                raise ValueError(
                    f"{_field(i, j, name)}: nbytes={nbytes} but shape {list(shape)} x {dt} needs {meta.nbytes}"
                )
            if offset < end_prev or offset % dt.itemsize:
                raise ValueError(f"{_field(i, j, name)}: offset {offset} overlaps the previous tensor or is misaligned")
            end_prev = offset + nbytes
            if end_prev > pb.nbytes:
                raise ValueError(f"{_field(i, j, name)}: ends at byte {end_prev}, past the bucket's {pb.nbytes} bytes")
            plan.slots.append(fast_slot(meta, offset))
        if (pb.num_tensors or len(plan.slots) != len(pb.tensors)) and pb.num_tensors != count - at_start:
            # a bucket with runs must say how many tensors they hold: limits are checked before expanding
            raise ValueError(
                f"manifest.buckets[{i}].num_tensors={pb.num_tensors} but its entries hold {count - at_start}"
            )
        total += pb.nbytes
        buckets.append(plan)
    if msg.total_bytes and total != msg.total_bytes:
        raise ValueError(f"manifest.total_bytes={msg.total_bytes} but its buckets add up to {total}")
    quantization = None
    if msg.HasField("quantization"):
        q = msg.quantization
        if not q.method:
            raise ValueError("manifest.quantization.method is empty (leave quantization unset for unquantized weights)")
        quantization = Quantization(q.method, q.fmt, tuple(q.weight_block_size))
    return Manifest(
        version=msg.version,
        sync_id=msg.sync_id,
        bucket_bytes=msg.bucket_bytes,
        buckets=buckets,
        model_family=msg.model_family,
        checksum_algo=msg.checksum_algo,
        origin=msg.origin,
        quantization=quantization,
        layout_digest=msg.layout_digest,
    )
