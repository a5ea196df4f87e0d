"""Run entries: one manifest entry for a run of same-shaped tensor blocks whose names differ in one index.

A MoE layer exports its N experts one after the other, each as the same few tensors (gate, up, down
projections, and in block FP8 each one's scale) of the same shapes and dtypes; the bucket plan lays
them out back to back, so expert E+1's block starts a fixed stride after expert E's. A full manifest
that names every one of them costs the trainer an encoded entry and the rollout a parsed, checked
entry per tensor: at Kimi-K2's 139,523 fp8 tensors, seconds per first sync. A run says it once:
`name` prefix, the first index, the count, the stride, and the block's members (suffix, dtype, shape,
offset within the block) — bus.proto TensorEntry.run_count.

This module writes runs (the trainer); `plan.manifest_from_proto` reads them back (the rollout).
The run is only a spelling: it expands to exactly the slots (names, shapes, dtypes, offsets) of the
plain entries, and the layout digest is that of the expanded layout, so a rollout that reads runs and
one sent plain entries hold one layout under one digest. The grouping needs no model knowledge: any
names with a numeric path component (`...experts.7.up_proj.weight`, also `model.layers.3....` when
whole layers share a bucket) group when the blocks agree.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from weightsync.bus import dtypes
from weightsync.bus.plan import BucketPlan, Manifest, Slot, TensorMeta, manifest_to_proto
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


def manifest_to_proto_runs(m: Manifest) -> bus_pb2.Manifest:
    """`m` on the wire with its runs as one entry each (plan.manifest_from_proto expands them back)."""
    msg = manifest_to_proto(dataclasses.replace(m, buckets=[]))
    msg.total_bytes = m.total_bytes
    for b in m.buckets:
        encode_bucket(msg.buckets.add(index=b.index, nbytes=b.nbytes, sender=b.sender), b)
    return msg
