"""The copy-and-checksum kernel over a table of 16-byte-aligned rows (scatter_rows.py), and its configs.

Each row is copied from the source base to the destination base (or only summed) and its two ws-sum64-v1
word sums (int64, wrapping) are stored per row; the caller adds the rows of each bucket. One launch can
cover one bucket or every bucket of a sync (the actor's own buckets, all unchanged while they are read):
one launch saves the tail of each launch's last wave and the gaps between launches. `Config` names the
launch shape; `config()` is the one the sync uses, the fastest that bench/bench_verified_copy.py
measured (docs/BENCHMARKS.md), and `CONFIGS` what that benchmark times (the one config, by name).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from weightsync.triton_support import available  # noqa: F401 (callers ask this module)


@dataclass(frozen=True)
class Config:
    name: str
    block: int = 2048  # words per inner step of one program
    steps: int = 32  # inner steps per row: a row is at most block * steps words
    warps: int = 4
    fold: int = 1  # adjacent words a thread adds before its int64 accumulators (1, 2 or 4)

    @property
    def row_words(self) -> int:
        return self.block * self.steps


#: 1024 words a step, 4 warps, the 4 words of each load added in-thread before the int64 accumulators
#: (rows of 256 KiB), one launch for every held bucket: of the launch shapes bench/bench_verified_copy.py
#: compared (block size, warps, fold, per-bucket launches, evict-first accesses, persistent programs,
#: and the per-bucket kernel of raw addresses that came before), the fastest on GPU at both model sizes.
DEFAULT = "vec-b1024-w4-f4"
CONFIGS = {DEFAULT: Config(DEFAULT, block=1024, steps=64, fold=4)}


def config() -> Config:
    """The launch shape the sync runs."""
    return CONFIGS[DEFAULT]


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    # n_rows unspecialised: one compilation whatever the count (Triton would compile one for a count
    # divisible by 16 and one for the others: a first sync of another model would pay a JIT)
    @triton.jit(do_not_specialize=["n_rows"])
    def scatter_sum64_vec(
        src_base,
        dst_base,
        table_ptr,
        out_ptr,
        n_rows,
        BLOCK: tl.constexpr,
        STEPS: tl.constexpr,
        VEC: tl.constexpr,
        FOLD: tl.constexpr,
    ):
        # table rows (kind, source offset, destination offset, count): kind 1 in units of VEC words
        # (so the compiler knows addresses and mask are VEC-aligned: 16-byte accesses), kind 2 single
        # words copied, kind 0 single words only summed. Offsets are words from the two bases.
        # A step is a [BLOCK // FOLD, FOLD] tile: each thread adds its FOLD adjacent words before the
        # int64 accumulators, which so take FOLD times fewer registers (more warps, more loads in flight).
        tile = tl.arange(0, BLOCK // FOLD)[:, None] * FOLD + tl.arange(0, FOLD)[None, :]
        # one program per row (the grid is the row count): the loop runs once
        for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            row = table_ptr + r * 4  # int32 offsets: rows stay far below 2**29
            kind = tl.load(row)
            s = tl.load(row + 1)
            d = tl.load(row + 2)
            n = tl.load(row + 3)
            acc1 = tl.zeros([BLOCK // FOLD], dtype=tl.int64)
            acc2 = tl.zeros([BLOCK // FOLD], dtype=tl.int64)
            if kind == 1:
                s = s * VEC
                d = d * VEC
                n = n * VEC
                for i in range(STEPS):
                    offs = i * BLOCK + tile
                    mask = offs < n
                    w = tl.load(src_base + s + offs, mask=mask, other=0)
                    tl.store(dst_base + d + offs, w, mask=mask)
                    acc1 += tl.sum(w.to(tl.int64), axis=1)
                    acc2 += tl.sum((w * w).to(tl.int64), axis=1)  # the square wraps in int32, as on the CPU path
            else:
                for i in range(STEPS):
                    offs = i * BLOCK + tile
                    mask = offs < n
                    w = tl.load(src_base + s + offs, mask=mask, other=0)
                    if kind == 2:
                        tl.store(dst_base + d + offs, w, mask=mask)
                    acc1 += tl.sum(w.to(tl.int64), axis=1)
                    acc2 += tl.sum((w * w).to(tl.int64), axis=1)
            tl.store(out_ptr + r * 2, tl.sum(acc1, axis=0))
            tl.store(out_ptr + r * 2 + 1, tl.sum(acc2, axis=0))

    return scatter_sum64_vec


@functools.lru_cache(maxsize=1)
def _short_kernel():
    """The same rows, for tables of many rows far shorter than a row's most words (a TP rank's column
    shard: one row per source row, e.g. 896 words at 7B): the inner loop runs only over the row's own
    steps, where the aligned-row kernel's fixed STEPS would spend most iterations masked. A separate
    function, so the aligned-row kernel of the plain path is compiled exactly as before."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_rows"])
    def scatter_sum64_short(
        src_base,
        dst_base,
        table_ptr,
        out_ptr,
        n_rows,
        BLOCK: tl.constexpr,
        STEPS: tl.constexpr,
        VEC: tl.constexpr,
        FOLD: tl.constexpr,
    ):
        # STEPS is unused here (the launch passes one config's fields); rows as in scatter_sum64_vec
        tile = tl.arange(0, BLOCK // FOLD)[:, None] * FOLD + tl.arange(0, FOLD)[None, :]
        for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            row = table_ptr + r * 4
            kind = tl.load(row)
            s = tl.load(row + 1)
            d = tl.load(row + 2)
            n = tl.load(row + 3)
            acc1 = tl.zeros([BLOCK // FOLD], dtype=tl.int64)
            acc2 = tl.zeros([BLOCK // FOLD], dtype=tl.int64)
            if kind == 1:
                s = s * VEC
                d = d * VEC
                n = n * VEC
                for i in range(0, tl.cdiv(n, BLOCK)):
                    offs = i * BLOCK + tile
                    mask = offs < n
                    w = tl.load(src_base + s + offs, mask=mask, other=0)
                    tl.store(dst_base + d + offs, w, mask=mask)
                    acc1 += tl.sum(w.to(tl.int64), axis=1)
                    acc2 += tl.sum((w * w).to(tl.int64), axis=1)
            else:
                for i in range(0, tl.cdiv(n, BLOCK)):
                    offs = i * BLOCK + tile
                    mask = offs < n
                    w = tl.load(src_base + s + offs, mask=mask, other=0)
                    if kind == 2:
                        tl.store(dst_base + d + offs, w, mask=mask)
                    acc1 += tl.sum(w.to(tl.int64), axis=1)
                    acc2 += tl.sum((w * w).to(tl.int64), axis=1)
            tl.store(out_ptr + r * 2, tl.sum(acc1, axis=0))
            tl.store(out_ptr + r * 2 + 1, tl.sum(acc2, axis=0))

    return scatter_sum64_short


_ANCHORS: dict[tuple, torch.Tensor] = {}


def anchor(device: torch.device) -> torch.Tensor:
    """A 16-byte aligned int32 tensor kept for the process's life: the base pointer the aligned-row
    tables' offsets count from (its address never changes, so a table built once stays valid)."""
    key = (device.type, device.index)
    a = _ANCHORS.get(key)
    if a is None:
        a = _ANCHORS[key] = torch.zeros(4, dtype=torch.int32, device=device)
    return a


def warm_up(device: torch.device) -> None:
    """Compile the configured kernel for `device` (CUDA) now, with one launch of an empty row
    (checksum.warm_up calls this at a service's start)."""
    a = anchor(device)
    launch(a, a, torch.zeros((1, 4), dtype=torch.int64, device=device), config())


def launch(
    src_base: torch.Tensor, dst_base: torch.Tensor, table: torch.Tensor, cfg: Config, short: bool = False
) -> torch.Tensor:
    """Run every row of `table` (int64 [rows, 4], scatter_rows.rows_of) from int32 `src_base` to int32
    `dst_base` (both 16-byte aligned for the vectorised rows to be fast; any 4-byte alignment is
    correct) and return the rows' word sums, int64 [rows, 2]. `short`: the short-row form (`_short_kernel`)."""
    from weightsync.bus.copy.scatter_rows import VEC

    rows = table.shape[0]
    partial = torch.empty((max(rows, 1), 2), dtype=torch.int64, device=table.device)
    if rows == 0:
        return partial.zero_()
    grid = rows
    kw = dict(BLOCK=cfg.block, STEPS=cfg.steps, VEC=VEC, FOLD=cfg.fold)
    kernel = _short_kernel() if short else _kernel()
    if table.device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1): the CPU tests
        kernel[(grid,)](src_base, dst_base, table, partial, rows, **kw)
        return partial
    with torch.cuda.device(table.device):
        kernel[(grid,)](src_base, dst_base, table, partial, rows, num_warps=cfg.warps, **kw)
    return partial
