"""Block-FP8 weights written by the trainer straight into an engine that dequantizes: one pass, no FP8 bytes.

A block-FP8 sync into the built-in engine quantizes every weight (the trainer: quantize_slots.py, into its
buckets), then dequantizes it into the engine's parameters (the rollout: dequantize_slots.py): two
passes over the weights and the e4m3 bytes between them. When the trainer writes into the engine
itself (ipc trainer_writes, weightsync/bus/ipc/trainer_writes.py) both happen in one: per 128x128
block the kernel (write_slots_triton.py) reads the weight's rows through the same row tables as the
quantizer, computes the block's scale and e4m3 codes, and stores the dequantized values into the
parameter; the codes and the scale are never stored, only summed, so the bucket checksums are those
of the FP8 buckets any other path sends (`ws-sum64-v1`: each FP8 and scale slot's word sums, which
the caller adds to those of the bucket's other bytes). The values are those fp8.quantize_torch then
fp8.dequantize_torch give, rounded once to the parameter's dtype (tests compare them bit for bit).

One launch per source dtype (in practice one per sync) over every FP8 weight of every bucket.
Without the kernel (no triton, or off the GPU) the same plan runs through the torch reference, weight
by weight: the same values and sums. Non-finite weights raise one device flag (`finite()`, one host
read), and `first_non_finite()` names the weight and block, as the quantizer's errors do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from weightsync.bus.copy.checksum import word_sums
from weightsync.formats.fp8.blocks import dequantize_torch, non_finite_error, quantize_torch
from weightsync.formats.fp8.quantize_slots import SOURCE_DTYPES, SlotWeight, _row_sources
from weightsync.formats.fp8.quantize_slots_triton import gpu_conversions
from weightsync.formats.fp8.spec import BLOCK, FP8_MAX, MIN_NORMAL
from weightsync.triton_support import available  # noqa: F401 (callers ask this module)

#: parameter dtypes the kernel writes (the rollout's fused dequantize writes the same ones)
OUT_DTYPES = (torch.bfloat16, torch.float32)
#: int64 fields per row of the tensor table: rows, cols, destination offset (elements of its dtype),
#: first row in the row table, first program, output float32
TENSOR_FIELDS = 6
#: rows a program holds at a time (quantize_slots_triton.py's: the same tile shape)
TILE_ROWS = 32
#: a program's warps, by whether the kernel rounds by the GPU's conversions (quantize_slots_triton.gpu_conversions):
#: 8 then, 4 with the bit arithmetic: the faster of the two in each case on GPU (bench/bench_fp8_slots.py's
#: fused_write_r<rows>w<warps> steps, docs/BENCHMARKS.md)
NUM_WARPS = {True: 8, False: 4}


class Launch(NamedTuple):
    """One kernel launch: the weights whose sources are of one dtype."""

    src_base: torch.Tensor
    rows: torch.Tensor
    tensors: torch.Tensor
    owners: torch.Tensor
    vec: int
    #: int64 [programs, 4]: each block's word sums, of its e4m3 words then of its scale's word
    sums: torch.Tensor
    #: int64 [programs]: the bucket of each block's e4m3 slot, and of its scale slot
    q_bucket: torch.Tensor
    s_bucket: torch.Tensor


class FusedWrite:
    """`weights` (a flat export's FP8 weights, quantize_slots.SlotWeight) written dequantized into `dests`
    (one per weight: the engine's parameter, contiguous, the weight's shape) at each `run()`, which
    returns the word sums of the FP8 and scale slots of each of `n_buckets` buckets. Sources and
    destinations must stay where they are between runs. Build with `plan`."""

    def __init__(self, weights: Sequence[SlotWeight], dests: Sequence[torch.Tensor], n_buckets: int, use_kernel: bool):
        self.weights, self.dests = list(weights), list(dests)
        self.n_buckets, self.use_kernel = n_buckets, use_kernel
        device = self.dests[0].device if self.dests else torch.device("cpu")
        self.device = device
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.launches: list[Launch] = []
        self._bases: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views = [w.pieces for w in self.weights]  # the tables hold raw addresses: keep the views
        #: bytes read from the sources and written into the parameters at each run
        self.bytes = sum(w.stand_in.numel() * (d.element_size() + _src_size(w)) for w, d in zip(self.weights, dests))

    def _fits(self) -> bool:
        """Every slot whole 32-bit words (its sums are then the bucket's words), every destination laid out."""
        for w, d in zip(self.weights, self.dests):
            shape = tuple(w.stand_in.shape)
            if w.q_offset % 4 or w.s_offset % 4 or (shape and shape[-1] % 4) or len(shape) < 2:
                return False
            if tuple(d.shape) != shape or not d.is_contiguous() or d.device != self.device:
                return False
            if not d.dtype.is_floating_point or (self.use_kernel and d.dtype not in OUT_DTYPES):
                return False
        return True

    def _build(self) -> bool:
        if not self._fits():
            return False
        if not self.use_kernel:
            return all(_row_sources(w, _probe(w)) is not None for w in self.weights)
        from weightsync.formats.fp8.quantize_slots_triton import vec_of

        dev = self.device
        # fresh allocations: aligned far beyond any element size; every address is an offset from them
        self._bases = (torch.empty(1, dtype=torch.int16, device=dev), torch.empty(1, dtype=torch.float32, device=dev))
        src_bases: dict[torch.dtype, torch.Tensor] = {}
        groups: dict[torch.dtype, list[tuple[SlotWeight, torch.Tensor, torch.Tensor]]] = {}
        for w, d in zip(self.weights, self.dests):
            dtypes = {src.dtype for _, src in w.pieces}
            if len(dtypes) != 1 or next(iter(dtypes)) not in SOURCE_DTYPES:
                return False
            dtype = dtypes.pop()
            if dtype not in src_bases:
                src_bases[dtype] = torch.empty(1, dtype=dtype, device=dev)
            rows = _row_sources(w, src_bases[dtype])
            if rows is None:
                return False
            groups.setdefault(dtype, []).append((w, d, rows))
        bf16_base, f32_base = self._bases
        for dtype, members in groups.items():
            tensors, owners, q_bucket, s_bucket, row_tables, row0 = [], [], [], [], [], 0
            vec = vec_of()
            for w, d, rows in members:
                base = f32_base if d.dtype == torch.float32 else bf16_base
                delta = d.data_ptr() - base.data_ptr()
                if delta % d.element_size():
                    return False
                d0 = delta // d.element_size()
                *lead, nr, nc = w.stand_in.shape
                nrb, ncb = -(-nr // BLOCK[0]), -(-nc // BLOCK[1])
                vec = vec_of(vec, nc, d0)
                while vec > 1 and bool((rows % vec).any()):
                    vec //= 2
                for m in range(math.prod(lead)):
                    if nr * nc:
                        tensors.append((nr, nc, d0 + m * nr * nc, row0 + m * nr, len(owners), int(base is f32_base)))
                        owners.extend([len(tensors) - 1] * (nrb * ncb))
                        q_bucket.extend([w.bucket] * (nrb * ncb))
                        s_bucket.extend([w.scale_bucket] * (nrb * ncb))
                row_tables.append(rows)
                row0 += rows.numel()
            if vec % 4:  # the sums need rows of whole words, at the access width the kernel proves
                return False
            if not owners:
                continue
            self.launches.append(
                Launch(
                    src_bases[dtype],
                    torch.cat(row_tables).to(dev),
                    torch.tensor(tensors, dtype=torch.int64).reshape(-1, TENSOR_FIELDS).to(dev),
                    torch.tensor(owners, dtype=torch.int32).to(dev),
                    vec,
                    torch.zeros(len(owners), 4, dtype=torch.int64, device=dev),
                    torch.tensor(q_bucket, dtype=torch.int64).to(dev),
                    torch.tensor(s_bucket, dtype=torch.int64).to(dev),
                )
            )
        return True

    def run(self) -> torch.Tensor:
        """Write every weight, dequantized, into its parameter (queued on the current stream); the
        int64 [n_buckets, 2] word sums of the FP8 and scale slots of each bucket, on the device."""
        self.flag.zero_()
        if not self.use_kernel:
            return self._run_torch()
        sums = torch.zeros(self.n_buckets, 2, dtype=torch.int64, device=self.device)
        for la in self.launches:
            _launch(la, self._bases, self.flag)
            sums.index_add_(0, la.q_bucket, la.sums[:, :2])
            sums.index_add_(0, la.s_bucket, la.sums[:, 2:])
        return sums

    def _assembled(self, w: SlotWeight) -> torch.Tensor:
        x = torch.empty(tuple(w.stand_in.shape), dtype=torch.float32, device=self.device)
        origin = w.stand_in.storage_offset()
        for dst, src in w.pieces:
            x.as_strided(dst.shape, dst.stride(), dst.storage_offset() - origin).copy_(src)
        return x

    def _run_torch(self) -> torch.Tensor:
        """The reference: each weight assembled in float32, quantized and dequantized by torch."""
        sums = torch.zeros(self.n_buckets, 2, dtype=torch.int64, device=self.device)
        for w, d in zip(self.weights, self.dests):
            if not w.stand_in.numel():
                continue
            q, s = quantize_torch(self._assembled(w))
            d.copy_(dequantize_torch(q, s, d.dtype))
            sums[w.bucket] += word_sums(q.reshape(-1).view(torch.int32)).to(sums.device)
            sums[w.scale_bucket] += word_sums(s.reshape(-1).view(torch.int32)).to(sums.device)
            self.flag |= (~torch.isfinite(s)).any().to(torch.int32)
        return sums

    def finite(self) -> bool:
        """Whether every block of the last `run()` was finite: one host synchronisation."""
        return not int(self.flag.item())

    def first_non_finite(self) -> ValueError | None:
        """The error naming the first weight (in plan order) and block that is not finite (read
        again from the sources: only after a run that raised the flag)."""
        for w in self.weights:
            if w.stand_in.numel():
                s = quantize_torch(self._assembled(w))[1]
                if not bool(torch.isfinite(s).all()):
                    return non_finite_error(s, w.name)
        return None


def _src_size(w: SlotWeight) -> int:
    return w.pieces[0][1].element_size() if w.pieces else 0


def _probe(w: SlotWeight) -> torch.Tensor:
    """A base for `_row_sources` on the torch path: one of the weight's sources (offsets unused)."""
    src = w.pieces[0][1] if w.pieces else torch.empty(0)
    return src.new_empty(1)


def _launch(la: Launch, bases: tuple[torch.Tensor, torch.Tensor], flag: torch.Tensor) -> None:
    from weightsync.formats.fp8.write_slots_triton import write_slots

    bf16_base, f32_base = bases
    grid = (la.owners.numel(),)
    args = (la.src_base, la.rows, la.tensors, la.owners, bf16_base, f32_base, flag, la.sums)
    cvt = gpu_conversions(la.owners.device)
    consts = dict(BR=BLOCK[0], BC=BLOCK[1], RB=TILE_ROWS, FMAX=FP8_MAX, SMIN=MIN_NORMAL, VEC=la.vec, CVT=cvt)
    if la.owners.device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1): the CPU tests
        write_slots[grid](*args, **consts)
        return
    with torch.cuda.device(la.owners.device):
        write_slots[grid](*args, **consts, num_warps=NUM_WARPS[cvt])


def plan(
    weights: Sequence[SlotWeight], dests: Sequence[torch.Tensor], n_buckets: int, use_kernel: bool | None = None
) -> FusedWrite | None:
    """A FusedWrite of `weights` into `dests`, or None when one cannot go this way (a slot that is not
    whole 32-bit words, rows that are not whole contiguous rows of a source, a destination not laid
    out as the weight or, for the kernel, not bf16 / float32 or not aligned for 4-element accesses):
    the caller quantizes into its buckets and dequantizes from there instead. `use_kernel` None: the
    Triton kernel where the destinations are on a CUDA device and triton is there."""
    if len(weights) != len(dests):
        raise ValueError(f"{len(weights)} FP8 weights, {len(dests)} destinations")
    if use_kernel is None:
        devices = {d.device for d in dests}
        use_kernel = len(devices) == 1 and next(iter(devices)).type == "cuda" and available()
    f = FusedWrite(weights, dests, n_buckets, use_kernel)
    return f if f._build() else None
