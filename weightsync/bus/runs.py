"""Run entries: one manifest entry for a run of same-shaped tensor blocks whose names differ in one index.

A MoE layer exports its N experts one after the other, each as the same few tensors (gate, up, down
projections, and in block FP8 each one's scale) of the same shapes and dtypes; the bucket plan lays
them out back to back, so expert E+1's block starts a fixed stride after expert E's. A full manifest
that names every one of them costs the trainer an encoded entry and the rollout a parsed, checked
entry per tensor: at Kimi-K2's 139,523 fp8 tensors, seconds per first sync. A run says it once:
`name` prefix, the first index, the count, the stride, and the block's members (suffix, dtype, shape,
offset within the block) — bus.proto TensorEntry.run_count.

The run is only a spelling: it expands to exactly the slots (names, shapes, dtypes, offsets) of the
plain entries, and the layout digest is that of the expanded layout, so a rollout that reads runs and
one sent plain entries hold one layout under one digest. The grouping needs no model knowledge: any
names with a numeric path component (`...experts.7.up_proj.weight`, also `model.layers.3....` when
whole layers share a bucket) group when the blocks agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from weightsync.bus import dtypes
from weightsync.bus.plan import MAX_TENSORS, BucketPlan, Slot, TensorMeta
from weightsync.v1 import bus_pb2

# prefix, index, suffix: the last numeric path component is the index (greedy prefix)
_INDEXED = re.compile(r"^(.*\.)(\d+)(\..+)$")


@dataclass
class _Block:
    """Consecutive slots of one bucket whose names share a prefix and an index."""

    prefix: str
    index: int
    start: int
    members: list[tuple[str, TensorMeta, int]]  # (suffix, meta, offset from start)
    slots: list[Slot]

    def signature(self) -> tuple:
        return tuple((suffix, m.shape, m.dtype, rel) for suffix, m, rel in self.members)


def _blocks(slots: list[Slot]) -> list[_Block | Slot]:
    out: list[_Block | Slot] = []
    cur: _Block | None = None
    for s in slots:
        match = _INDEXED.match(s.meta.name)
        if match is None or (len(match[2]) > 1 and match[2][0] == "0"):  # "07" would expand as "7"
            out.append(s)
            cur = None
            continue
        prefix, index, suffix = match[1], int(match[2]), match[3]
        if cur is None or cur.prefix != prefix or cur.index != index:
            cur = _Block(prefix, index, s.offset, [], [])
            out.append(cur)
        cur.members.append((suffix, s.meta, s.offset - cur.start))
        cur.slots.append(s)
    return out


@dataclass
class Run:
    """A run of `len(blocks)` blocks, the first's index `blocks[0].index`, `stride` bytes apart."""

    blocks: list[_Block]
    stride: int

    def joins(self, b: _Block) -> bool:
        first, last = self.blocks[0], self.blocks[-1]
        if b.prefix != first.prefix or b.index != last.index + 1 or b.signature() != first.signature():
            return False
        return len(self.blocks) == 1 or b.start - last.start == self.stride


def group(slots: list[Slot]) -> list[Run | Slot]:
    """A bucket's slots, in order, as runs of two blocks or more and single slots."""
    out: list[Run | Slot] = []
    run: Run | None = None

    def close() -> None:
        if run is None:
            return
        if len(run.blocks) > 1:
            out.append(run)
        else:
            out.extend(run.blocks[0].slots)

    for item in _blocks(slots):
        if isinstance(item, Slot):
            close()
            run = None
            out.append(item)
        elif run is not None and run.joins(item):
            if len(run.blocks) == 1:
                run.stride = item.start - run.blocks[0].start
            run.blocks.append(item)
        else:
            close()
            run = Run([item], 0)
    close()
    return out


def encode_bucket(pb: bus_pb2.BucketSpec, b: BucketPlan) -> None:
    """Fill `pb.tensors` with `b`'s slots, runs as one entry each (and `pb.num_tensors`)."""
    for item in group(b.slots):
        if isinstance(item, Slot):
            m = item.meta
            pb.tensors.add(
                name=m.name, dtype=dtypes.to_wire(m.dtype), shape=list(m.shape), offset=item.offset, nbytes=m.nbytes
            )
            continue
        first = item.blocks[0]
        entry = pb.tensors.add(
            name=first.prefix,
            offset=first.start,
            run_count=len(item.blocks),
            run_first=first.index,
            run_stride=item.stride,
        )
        for suffix, m, rel in first.members:
            entry.run_members.add(
                name=suffix, dtype=dtypes.to_wire(m.dtype), shape=list(m.shape), offset=rel, nbytes=m.nbytes
            )
    pb.num_tensors = len(b.slots)


def _where(bucket: int, tensor: int, t) -> str:
    return f"manifest.buckets[{bucket}].tensors[{tensor}] (run {t.name!r}{{{t.run_first}..}})"


def expand(
    t, bucket: int, tensor: int, end_prev: int, bucket_nbytes: int, names: set[str], count: int, out: list[Slot]
):
    """Validate the run entry `t` and append the slots it stands for to `out`; (end offset, count).

    One check per member covers every block (same shape, dtype and offset within each); the names are
    checked unique one by one, as a plain manifest's are.
    """
    where = _where(bucket, tensor, t)
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
