"""Block FP8 weights quantized straight into their bucket slots, planned once per layout.

The exported stream (export.py) quantizes one tensor at a time into new tensors that the
pipeline then packs: per weight a launch, a temporary and a copy. When the buckets are fixed memory
whose layout does not change between syncs (a one-rank trainer's flat export,
trainer_svc/actor/megatron/flat_export.py), every weight's e4m3 bytes and scale have a fixed place,
and so does each of its rows in the parameter it comes from. Here those places become tables,
built once: each sync is then one Triton launch per bucket (per source dtype, in practice one)
over every 128x128 block of the bucket's weights (quantize_slots_triton.py), writing exactly the bytes
fp8.quantize writes (tests/unit/weightsync/formats/fp8/test_fp8_slots.py).

A weight is described by where its rows come from: copy pairs (a region of the weight, as a view of
a stand-in with no memory from `stand_ins`, and the view of the source that belongs there), the
same pairs a plain export copies. Only whole, contiguous rows are taken (every export transform of
a linear weight moves whole rows: the QKV split, gate/up, the TP concatenation along rows);
`plan` returns None for anything else, and the caller keeps the per-tensor path.

Non-finite weights: a block whose scale is inf raises one device flag (no host wait per tensor);
`finite()` reads it once per sync, and `first_non_finite()` names the tensor for the error.
Without the kernel (no triton, or off the GPU) the same plan runs through the torch reference,
tensor by tensor: the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from weightsync.bus.copy.checksum import word_sums
from weightsync.formats.fp8.blocks import non_finite_error, quantize_torch, scale_shape
from weightsync.formats.fp8.spec import BLOCK, SCALE_DTYPE

#: source dtypes the kernel reads (the quantizer's own inputs)
SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def stand_ins(shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Meta-device tensors of `shapes` over one storage, disjoint: a copy pair's destination view of
    one of them says which of its elements the pair writes (storage offset and strides), with no memory."""
    space = torch.empty(sum(math.prod(s) for s in shapes), device="meta")
    out, pos = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(space[pos : pos + n].view(s))
        pos += n
    return out


@dataclass
class SlotWeight:
    """One weight to quantize: its e4m3 slot at byte `q_offset` of bucket `bucket`, its float32
    scale slot at byte `s_offset` of bucket `scale_bucket` (default the same: a plan may put the
    scale at the end of the bucket before), and `pieces`, (view of `stand_in`, source view) pairs
    that cover it."""

    name: str
    bucket: int
    q_offset: int
    s_offset: int
    stand_in: torch.Tensor
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    scale_bucket: int | None = None

    def __post_init__(self):
        if self.scale_bucket is None:
            self.scale_bucket = self.bucket


def _grid(t: torch.Tensor, origin: int) -> torch.Tensor:
    """The element offset (from `origin`) of the first element of every row of view `t`, int64, flat."""
    off = torch.tensor(t.storage_offset() - origin, dtype=torch.int64)
    for n, st in zip(t.shape[:-1], t.stride()[:-1]):
        off = off[..., None] + torch.arange(n, dtype=torch.int64) * st
    return off.reshape(-1)


def _row_sources(w: SlotWeight, base: torch.Tensor) -> torch.Tensor | None:
    """int64 [rows of w]: each HF row's first source element, counted from `base` (same dtype), or
    None when the pieces are not whole contiguous rows covering every row once."""
    shape = tuple(w.stand_in.shape)
    cols = shape[-1]
    nrows = math.prod(shape[:-1])
    origin = w.stand_in.storage_offset()
    table = torch.zeros(nrows, dtype=torch.int64)
    seen = torch.zeros(nrows, dtype=torch.bool)
    esize = base.element_size()
    for dst, src in w.pieces:
        if dst.numel() == 0:
            continue
        if dst.dim() == 0 or dst.shape[-1] != cols or src.dtype != base.dtype or tuple(src.shape) != tuple(dst.shape):
            return None
        if cols > 1 and (dst.stride(-1) != 1 or src.stride(-1) != 1):
            return None
        delta = src.data_ptr() - base.data_ptr()
        if delta % esize:
            return None
        d = _grid(dst, origin)
        if bool((d % cols != 0).any()) or bool((d < 0).any()) or bool((d >= nrows * cols).any()):
            return None
        rows = d // cols
        if bool(seen[rows].any()):
            return None
        seen[rows] = True
        table[rows] = _grid(src, src.storage_offset()) + delta // esize
    if not bool(seen.all()):
        return None
    return table


class Launch(NamedTuple):
    """One kernel launch: the weights of one (bucket, scale bucket, source dtype)."""

    src_base: torch.Tensor
    rows: torch.Tensor
    tensors: torch.Tensor
    owners: torch.Tensor
    q_base: torch.Tensor
    s_base: torch.Tensor
    #: what every column count and offset of the tables is a multiple of (quantize_slots_triton.vec_of)
    vec: int
    #: int64 [programs, 4]: each block's word sums (its e4m3 words, its scale's word), vec % 4 == 0
    sums: torch.Tensor
    bucket: int
    scale_bucket: int


class QuantizeIntoSlots:
    """Quantizes the weights of `weights` into `flats` (one flat uint8 buffer per bucket) at each
    `run()`; sources and buffers must stay where they are between runs (the caller replans when
    one moves). Build with `plan`, which says None for what it cannot take."""

    def __init__(self, flats: Sequence[torch.Tensor], weights: Sequence[SlotWeight], use_kernel: bool):
        self.flats = list(flats)
        self.weights = list(weights)
        self.use_kernel = use_kernel
        device = self.flats[0].device if self.flats else torch.device("cpu")
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._views = [w.pieces for w in self.weights]  # the table holds raw addresses: keep the views
        self.launches: list[Launch] = []
        #: int64 [buckets, 2]: the word sums of every FP8 and scale slot of each bucket, as the last
        #: run() wrote them (None: a slot that is not whole 32-bit words; see `word_sums`)
        self._sums: torch.Tensor | None = None
        #: whether run() keeps them (benchmarks time the launches without, bench_fp8_slots.py)
        self.keep_sums = True
        self._rows: list[torch.Tensor] = []
        self.bytes = sum(w.stand_in.numel() + 4 * math.prod(scale_shape(w.stand_in.shape)) for w in self.weights)

    def _build(self) -> bool:
        from weightsync.formats.fp8.quantize_slots_triton import TENSOR_FIELDS, vec_of

        bases: dict[torch.dtype, torch.Tensor] = {}
        # one launch per (weight bucket, scale bucket, source dtype): in practice one per bucket
        groups: dict[tuple[int, int, torch.dtype], list[tuple[SlotWeight, torch.Tensor]]] = {}
        for w in self.weights:
            dtypes = {src.dtype for _, src in w.pieces}
            if len(dtypes) != 1 or next(iter(dtypes)) not in SOURCE_DTYPES:
                return False
            dtype = dtypes.pop()
            if dtype not in bases:  # a fresh allocation: aligned far beyond any element size
                bases[dtype] = torch.empty(1, dtype=dtype, device=self.flag.device)
            rows = _row_sources(w, bases[dtype])
            if rows is None:
                return False
            self._rows.append(rows)
            groups.setdefault((w.bucket, w.scale_bucket, dtype), []).append((w, rows))
        for (bucket, scale_bucket, dtype), members in groups.items():
            flat, sflat = self.flats[bucket], self.flats[scale_bucket]
            tensors, owners, row_tables, row0 = [], [], [], 0
            vec = vec_of()  # the launch's widest access: what divides every offset it reads from the tables
            for w, rows in members:
                *lead, nr, nc = w.stand_in.shape
                nrb, ncb = -(-nr // BLOCK[0]), -(-nc // BLOCK[1])
                vec = vec_of(vec, nc, w.q_offset)
                while vec > 1 and bool((rows % vec).any()):  # every source row's first element too
                    vec //= 2
                for m in range(math.prod(lead)):
                    if nr * nc:
                        first = len(owners)
                        tensors.append(
                            (nr, nc, w.q_offset + m * nr * nc, w.s_offset // 4 + m * nrb * ncb, row0 + m * nr, first)
                        )
                        owners.extend([len(tensors) - 1] * (nrb * ncb))
                row_tables.append(rows)
                row0 += rows.numel()
            if not owners:
                continue
            dev = flat.device
            table = torch.tensor(tensors, dtype=torch.int64).reshape(-1, TENSOR_FIELDS).to(dev)
            whole = sflat.numel() - sflat.numel() % 4
            self.launches.append(
                Launch(
                    bases[dtype],
                    torch.cat(row_tables).to(dev),
                    table,
                    torch.tensor(owners, dtype=torch.int32).to(dev),
                    flat,
                    sflat[:whole].view(torch.float32),
                    vec,
                    torch.zeros(len(owners), 4, dtype=torch.int64, device=dev),
                    bucket,
                    scale_bucket,
                )
            )
        return True

    def run(self) -> None:
        """Write every weight's e4m3 bytes and scales into its slots (queued on the current stream)."""
        self.flag.zero_()
        if not self.use_kernel:
            self._run_torch()
            return
        from weightsync.formats.fp8 import quantize_slots_triton as kernel

        summed = self.keep_sums and bool(self.flats) and all(la.vec % 4 == 0 for la in self.launches)
        for la in self.launches:
            sums = la.sums if summed else None
            kernel.launch(la.src_base, la.rows, la.tensors, la.owners, la.q_base, la.s_base, la.vec, sums, self.flag)
        self._sums = None
        if summed:
            sums = torch.zeros(len(self.flats), 2, dtype=torch.int64, device=self.flag.device)
            for la in self.launches:
                part = la.sums.sum(dim=0)
                sums[la.bucket] += part[:2]
                sums[la.scale_bucket] += part[2:]
            self._sums = sums

    def word_sums(self) -> torch.Tensor | None:
        """int64 [buckets, 2]: the ws-sum64 word sums of the FP8 and scale slots (`slot_ranges`) of
        each bucket as the last run() wrote them, on the buckets' device (queued, no host wait), so
        a bucket's checksum reads only its other bytes; None where a slot is not whole 32-bit words
        (a weight whose columns or offset are not multiples of 4)."""
        return self._sums

    def slot_ranges(self) -> list[list[tuple[int, int]]]:
        """Per bucket, the byte ranges [start, end) of the FP8 and scale slots, sorted."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.flats]
        for w in self.weights:
            n = w.stand_in.numel()
            if n:
                out[w.bucket].append((w.q_offset, w.q_offset + n))
                out[w.scale_bucket].append((w.s_offset, w.s_offset + 4 * math.prod(scale_shape(w.stand_in.shape))))
        return [sorted(r) for r in out]

    def _run_torch(self) -> None:
        """The reference: each weight assembled in float32, quantized by fp8.quantize_torch."""
        for w in self.weights:
            shape = tuple(w.stand_in.shape)
            if not math.prod(shape):
                continue
            x = torch.empty(shape, dtype=torch.float32, device=self.flag.device)
            origin = w.stand_in.storage_offset()
            for dst, src in w.pieces:
                x.as_strided(dst.shape, dst.stride(), dst.storage_offset() - origin).copy_(src)
            q, s = quantize_torch(x)
            flat, sflat = self.flats[w.bucket], self.flats[w.scale_bucket]
            flat[w.q_offset : w.q_offset + q.numel()].copy_(q.reshape(-1).view(torch.uint8))
            sflat[w.s_offset : w.s_offset + 4 * s.numel()].copy_(s.reshape(-1).view(torch.uint8))
            self.flag |= (~torch.isfinite(s)).any().to(torch.int32)
        # the kernel's word sums, from the bytes written (the same values)
        self._sums = None
        if self.keep_sums and all(w.q_offset % 4 == 0 and w.stand_in.numel() % 4 == 0 for w in self.weights):
            sums = torch.zeros(len(self.flats), 2, dtype=torch.int64, device=self.flag.device)
            for b, ranges in enumerate(self.slot_ranges()):
                for start, end in ranges:
                    sums[b] += word_sums(self.flats[b][start:end].view(torch.int32)).to(sums.device)
            self._sums = sums

    def finite(self) -> bool:
        """Whether every block of the last `run()` was finite: one host synchronisation."""
        return not int(self.flag.item())

    def scales(self, w: SlotWeight) -> torch.Tensor:
        """`w`'s scales as they lie in its bucket."""
        n = math.prod(scale_shape(w.stand_in.shape))
        flat = self.flats[w.scale_bucket]
        return flat[w.s_offset : w.s_offset + 4 * n].view(SCALE_DTYPE).view(scale_shape(w.stand_in.shape))

    def first_non_finite(self) -> ValueError | None:
        """The error naming the first weight (in plan order) and block whose scale is inf or nan."""
        for w in self.weights:
            s = self.scales(w)
            if s.numel() and not bool(torch.isfinite(s).all()):
                return non_finite_error(s, w.name)
        return None


def plan(flats: Sequence[torch.Tensor], weights: Sequence[SlotWeight], use_kernel: bool | None = None):
    """A QuantizeIntoSlots for `weights`, or None when one of them is not whole contiguous rows of
    a source in a dtype the quantizer reads (the caller then quantizes tensor by tensor).
    `use_kernel` None: the Triton kernel where every buffer is on one CUDA device and triton is there."""
    from weightsync.formats.fp8 import quantize_slots_triton

    devices = {f.device for f in flats}
    if use_kernel is None:
        use_kernel = len(devices) == 1 and next(iter(devices)).type == "cuda" and quantize_slots_triton.available()
    q = QuantizeIntoSlots(flats, weights, use_kernel)
    if not q._build():
        return None
    return q
