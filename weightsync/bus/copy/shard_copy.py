"""A TP rank's copy of its shards out of a bucket, checksummed so that the ranks' sums add up to the bucket's.

A tensor-parallel rank holds part of most tensors: a range of rows (a column-parallel weight, a vocabulary
shard: one contiguous byte range of the bucket) or a range of columns (a row-parallel weight: `rows` runs of
`row_bytes` at a source stride). A `Piece` is one such region of one slot and the contiguous destination it
is copied into; a slot the rank holds whole (a norm, a replicated bias) is one piece covering the slot.

The checksum (`ws-sum64-v1`, checksum.py) is a wrapping sum of words and of their squares: additive over
disjoint sets of words. So each rank reports two pairs of sums per bucket:

- `common`: every whole word of the bucket except those of the slots this rank shards (the alignment gaps,
  the tensors every rank holds whole, the last partial word of every tensor): the same on every rank;
- `shard`: the words of this rank's shard pieces, read as they are copied.

The rollout checks that the ranks' `common` agree and adds their `shard` sums to it: when the ranks' pieces
of each sharded slot cover its whole words exactly once, the total is the bucket's, so a match proves the
bucket arrived whole and every rank copied the trainer's bytes (each word of a shard is summed by the rank
that wrote it; each word of a replicated tensor by every rank). Ranks whose pieces overlap or leave a gap
give another total: the sync fails, never passes. A shard edge inside a 4-byte word (a bf16 column range
of odd width) cannot be summed by one rank alone: `check` refuses such a layout (the caller keeps its
model's loader). On CUDA the copy is the copy-and-checksum kernel (scatter_triton.py): the plain regions in
its aligned-row launch, the column shards' rows (many short rows) in the same kernel's short-row form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weightsync.bus.copy.checksum import word_sums
from weightsync.bus.plan import BucketPlan

COMMON, SHARD = 0, 1


@dataclass(frozen=True)
class Piece:
    """Bytes `src + r * stride + [0, row_bytes)` of the bucket, for r < rows, into contiguous `dst`."""

    slot: int
    src: int
    rows: int
    row_bytes: int
    stride: int
    dst: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def whole(self, plan: BucketPlan) -> bool:
        s = plan.slots[self.slot]
        return self.rows == 1 and self.src == s.offset and self.row_bytes == s.meta.nbytes


def check(plan: BucketPlan, pieces: Sequence[Piece]) -> str:
    """Why these pieces cannot be copied and summed as words ('' when they can)."""
    for p in pieces:
        s = plan.slots[p.slot]
        name = s.meta.name
        end_of_slot = s.offset + s.meta.nbytes
        last = p.src + (p.rows - 1) * p.stride + p.row_bytes
        if p.src < s.offset or last > end_of_slot or p.rows < 1 or p.row_bytes < 1:
            return f"{name}: a copied region lies outside the tensor's bytes"
        if not p.dst.is_contiguous() or p.dst.numel() * p.dst.element_size() != p.nbytes:
            return f"{name}: the destination of a shard is not one contiguous region of its size"
        if p.src % 4 or p.dst.data_ptr() % 4:
            return f"{name}: a shard starts inside a 4-byte word (its sums cannot be one rank's)"
        if p.rows > 1 and (p.row_bytes % 4 or p.stride % 4):
            return f"{name}: a column shard's rows are not whole 4-byte words"
        if p.rows == 1 and p.row_bytes % 4 and last != end_of_slot:
            return f"{name}: a shard ends inside a 4-byte word before the tensor's end"
    by_slot: dict[int, list[Piece]] = {}
    for p in pieces:
        by_slot.setdefault(p.slot, []).append(p)
    for i, ps in by_slot.items():
        if len(ps) > 1 and any(p.whole(plan) for p in ps):
            return f"{plan.slots[i].meta.name}: copied whole and again"
        if len(ps) > 1 and _overlap(ps):
            return f"{plan.slots[i].meta.name}: two shards copied from the same bytes (their sums would count twice)"
    return ""


def _overlap(pieces: Sequence[Piece]) -> bool:
    """Whether any two rows of these pieces share a byte (once per layout: numpy over every row's range)."""
    starts = np.concatenate([p.src + np.arange(p.rows, dtype=np.int64) * p.stride for p in pieces])
    ends = np.concatenate([p.src + np.arange(p.rows, dtype=np.int64) * p.stride + p.row_bytes for p in pieces])
    order = np.argsort(starts, kind="stable")
    return bool((starts[order][1:] < ends[order][:-1]).any())


def sharded_slots(plan: BucketPlan, pieces: Sequence[Piece]) -> set[int]:
    return {p.slot for p in pieces if not p.whole(plan)}


def common_regions(plan: BucketPlan, pieces: Sequence[Piece]) -> list[tuple[int, int, torch.Tensor | None]]:
    """The `common` words as (first word, count, destination or None: only summed): the bucket's whole
    words outside the sharded slots' whole words; a slot held whole is copied as it is summed."""
    sharded = sharded_slots(plan, pieces)
    whole_dst = {p.slot: p.dst for p in pieces if p.slot not in sharded}
    out, pos = [], 0
    for i, slot in enumerate(plan.slots):
        off, nb = slot.offset, slot.meta.nbytes  # aligned offsets (plan.ALIGN): whole words
        if off > pos:
            out.append((pos // 4, (off - pos) // 4, None))
        whole = nb - nb % 4
        if whole and i not in sharded:
            out.append((off // 4, whole // 4, whole_dst.get(i)))
        pos = off + whole  # a tensor's last partial word is summed with the gap after it
    end = plan.nbytes - plan.nbytes % 4
    if end > pos:
        out.append((pos // 4, (end - pos) // 4, None))
    return out


def shard_words(p: Piece) -> tuple[int, int]:
    """(words per row, the row's partial bytes) of a shard piece: a row piece that ends a tensor of odd
    size leaves its last bytes to the gap's word (`common`), copied apart."""
    return p.row_bytes // 4, p.row_bytes % 4


def bytes_read(plan: BucketPlan, pieces: Sequence[Piece]) -> int:
    """The bucket's bytes this rank reads: its common words and its shards."""
    n = sum(4 * count for _, count, _ in common_regions(plan, pieces))
    sharded = sharded_slots(plan, pieces)
    return n + sum(p.nbytes for p in pieces if p.slot in sharded)


def copy_sharded(plan: BucketPlan, buf: torch.Tensor, pieces: Sequence[Piece]) -> torch.Tensor:
    """Copy every piece out of `buf` and return int64 [2, 2]: the `common` and `shard` word sums (torch,
    any device; the reference of the kernel's form, `copy_sharded_all`)."""
    end = plan.nbytes - plan.nbytes % 4
    words = buf[:end].view(torch.int32)
    sums = torch.zeros(2, 2, dtype=torch.int64, device=buf.device)
    for first, count, dst in common_regions(plan, pieces):
        sums[COMMON] += word_sums(words[first : first + count])
        if dst is not None:
            dst.detach().reshape(-1).view(torch.uint8)[: 4 * count].copy_(buf[4 * first : 4 * (first + count)])
    sharded = sharded_slots(plan, pieces)
    for p in pieces:
        if p.slot in sharded:
            # as_strided from a view at the piece's start: its storage offset is the view's own
            src = buf[p.src :].as_strided((p.rows, p.row_bytes), (p.stride, 1))
            _flat(p.dst).view(p.rows, p.row_bytes).copy_(src)
            n_words, _ = shard_words(p)
            if n_words:
                w = words[p.src // 4 :].as_strided((p.rows, n_words), (p.stride // 4, 1))
                sums[SHARD] += word_sums(w.reshape(-1) if w.is_contiguous() else w)
    _copy_tails(plan, buf, pieces, sharded)
    return sums


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _copy_tails(plan: BucketPlan, buf: torch.Tensor, pieces: Sequence[Piece], sharded: set[int]) -> None:
    """The last bytes of a slot held whole that do not fill a word (the kernel moves words only)."""
    for p in pieces:
        nb = plan.slots[p.slot].meta.nbytes
        if p.slot not in sharded and nb % 4:
            whole = nb - nb % 4
            _flat(p.dst)[whole:].copy_(buf[p.src + whole : p.src + nb])


def copy_sharded_all(
    plans: Sequence[BucketPlan],
    bufs: Sequence[torch.Tensor],
    pieces: Sequence[Sequence[Piece]],
    cache: dict | None,
    src_relative: bool = False,
) -> torch.Tensor:
    """`copy_sharded` of every bucket, int64 [buckets, 2, 2], queued on the current stream: on CUDA with
    Triton one launch of the aligned-row kernel for the common regions and the row shards, one of its
    short-row form for the column shards' rows (their tables built once per set of buffers, in `cache`).
    `src_relative` (one bucket): the tables' source offsets count from the bucket's buffer, so `cache` serves
    any buffer at the same alignment (a receiver's buffers change between syncs; the tables are built once)."""
    if not (bufs and bufs[0].is_cuda and _fused()):
        return torch.stack([copy_sharded(p, b, ps) for p, b, ps in zip(plans, bufs, pieces)])
    from weightsync.bus.copy import scatter_triton

    cfg = scatter_triton.config()
    anchor = scatter_triton.anchor(bufs[0].device)
    src_base = anchor
    if src_relative:
        if len(bufs) != 1:
            raise ValueError(f"src_relative copies one bucket, got {len(bufs)}")
        src_base = bufs[0][: bufs[0].numel() - bufs[0].numel() % 4].view(torch.int32)
    key = ("shard-tables", cfg.row_words, src_base.data_ptr() % 16 if src_relative else None)
    tables = None if cache is None else cache.get(key)
    if tables is None:
        tables = _tables(plans, bufs, pieces, cfg.row_words, src_base.data_ptr())
        if cache is not None:
            cache[key] = tables
    sums = torch.zeros((2 * len(plans), 2), dtype=torch.int64, device=anchor.device)
    for short, (table, owner) in zip((False, True), tables):
        if table is not None:
            sums.index_add_(0, owner, scatter_triton.launch(src_base, anchor, table, cfg, short=short))
    tails = None if cache is None else cache.get("tails")
    if tails is None:
        tails = _tails(plans, pieces)
        if cache is not None:
            cache["tails"] = tails
    for b, dst, start, end in tails:
        dst.copy_(bufs[b][start:end])
    return sums.view(len(plans), 2, 2)


def _tails(plans, pieces) -> list[tuple[int, torch.Tensor, int, int]]:
    """(bucket, destination bytes, source start, end) of the bytes the kernel does not move (it moves words):
    the last bytes of a tensor held whole, and of a row shard that ends a tensor of odd size."""
    out = []
    for b, (plan, ps) in enumerate(zip(plans, pieces)):
        sharded = sharded_slots(plan, ps)
        for p in ps:
            nb = plan.slots[p.slot].meta.nbytes
            if p.slot not in sharded and nb % 4:
                whole = nb - nb % 4
                out.append((b, _flat(p.dst)[whole:], p.src + whole, p.src + nb))
            elif p.slot in sharded:
                n_words, rest = shard_words(p)
                if rest:
                    out.append((b, _flat(p.dst)[4 * n_words :], p.src + 4 * n_words, p.src + p.row_bytes))
    return out


def _tables(plans, bufs, pieces, row_words: int, src_base: int):
    """(table, owner) for the long regions and for the column shards' rows (None where there are none):
    scatter_rows rows whose owner is 2 * bucket + (COMMON or SHARD); source offsets from `src_base`."""
    from weightsync.bus.copy import scatter_rows, scatter_triton

    long, short = [], []
    for plan, buf, ps in zip(plans, bufs, pieces):
        regions = [
            (first, count, 0 if d is None else d.data_ptr(), COMMON) for first, count, d in common_regions(plan, ps)
        ]
        rows = []
        sharded = sharded_slots(plan, ps)
        for p in ps:
            n_words, _ = shard_words(p)
            if p.slot not in sharded or not n_words:
                continue
            if p.rows == 1:
                regions.append((p.src // 4, n_words, p.dst.data_ptr(), SHARD))
            else:
                dst = p.dst.data_ptr()
                rows += [((p.src + r * p.stride) // 4, n_words, dst + r * p.row_bytes, SHARD) for r in range(p.rows)]
        long.append((buf.data_ptr(), regions))
        short.append((buf.data_ptr(), rows))
    anchor = scatter_triton.anchor(bufs[0].device)
    out = []
    for buckets in (long, short):
        if not any(regions for _, regions in buckets):
            out.append((None, None))
            continue
        rows, owner = scatter_rows.rows_of(buckets, src_base, anchor.data_ptr(), row_words, groups=2)
        device = bufs[0].device
        out.append(
            (torch.tensor(rows, dtype=torch.int64).to(device), torch.tensor(owner, dtype=torch.int64).to(device))
        )
    return out


def _fused() -> bool:
    from weightsync.bus.copy import checksum_triton  # lazy: triton comes only with CUDA builds of torch

    return checksum_triton.available()
