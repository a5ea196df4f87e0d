"""The copy-and-checksum kernel over a table of 16-byte-aligned rows (scatter_rows.py), and its configs.

Each row is copied from the source base to the destination base (or only summed) and its two ws-sum64-v1
word sums (int64, wrapping) are stored per row; the caller adds the rows of each bucket. One launch can
cover one bucket or every bucket of a sync (the actor's own buckets, all unchanged while they are read):
one launch saves the tail of each launch's last wave and the gaps between launches. `Config` names the
launch shape; `CONFIGS` holds those the microbenchmark compares (bench/bench_verified_copy.py) and
`config()` the one the sync uses (the config's `debug.verified_copy=<name>` picks another; `legacy` is the kernel of
checksum_cuda.scatter_word_sums, one launch per bucket, kept until the GPU numbers settle it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from weightsync.debug import switches
from weightsync.triton_support import available  # noqa: F401 (callers ask this module)


@dataclass(frozen=True)
class Config:
    name: str
    kernel: str = "vec"  # "vec": this module's kernel; "legacy": checksum_cuda.scatter_word_sums
    block: int = 2048  # words per inner step of one program
    steps: int = 32  # inner steps per row: a row is at most block * steps words
    warps: int = 4
    one_launch: bool = True  # copy_all_into: one launch over every bucket (else one per bucket)
    per_sm: int = 0  # programs per SM looping over the rows; 0: one program per row
    evict_first: bool = False  # loads and stores marked evict-first (each byte is touched once)
    fold: int = 1  # adjacent words a thread adds before its int64 accumulators (1, 2 or 4)

    @property
    def row_words(self) -> int:
        return self.block * self.steps


def _configs() -> dict[str, Config]:
    out = [
        Config("legacy", kernel="legacy", block=4096, steps=16, one_launch=False),
        Config("vec-b2048-w4-f4", fold=4),
        Config("vec-b2048-w4-f4-bucket", fold=4, one_launch=False),
        Config("vec-b2048-w4"),
        Config("vec-b4096-w8-f4", block=4096, steps=16, warps=8, fold=4),
        Config("vec-b2048-w8-f4", warps=8, fold=4),
        Config("vec-b1024-w4-f4", block=1024, steps=64, fold=4),
        Config("vec-b4096-w4-f4", block=4096, steps=16, fold=4),
        Config("vec-b2048-w4-f4-evict", fold=4, evict_first=True),
        Config("vec-b2048-w4-f4-persist6", fold=4, per_sm=6),
    ]
    return {c.name: c for c in out}


CONFIGS = _configs()
#: Measured on an H200 (bench/bench_verified_copy.py, 2026-11-26, docs/BENCHMARKS.md): every `vec` config
#: makes 16-byte accesses (LDG.E.128 / STG.E.128, the width a plain copy_ uses; `legacy` makes 4-byte ones)
#: and beats `legacy` (7B: 8.9 ms against a 7.15 ms copy_ of the same 15.2 GB); 1024 words a step, 4 warps,
#: the 4 words of each load added in-thread before the int64 accumulators, rows of 256 KiB and one launch
#: for every held bucket was the fastest at both sizes (7B 8.20 ms, 1.5B 1.86 ms against 1.45), the others
#: within 2 % except 4096 words at 4 warps (1.4x slower).
DEFAULT = "vec-b1024-w4-f4"


def config() -> Config:
    name = switches().verified_copy or DEFAULT  # the config's debug.verified_copy
    c = CONFIGS.get(name)
    if c is None:
        raise ValueError(f"debug.verified_copy={name!r} is not a kernel config; use one of {', '.join(CONFIGS)}")
    return c


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
        EVICT: tl.constexpr,
    ):
        # table rows (kind, source offset, destination offset, count): kind 1 in units of VEC words
        # (so the compiler knows addresses and mask are VEC-aligned: 16-byte accesses), kind 2 single
        # words copied, kind 0 single words only summed. Offsets are words from the two bases.
        # A step is a [BLOCK // FOLD, FOLD] tile: each thread adds its FOLD adjacent words before the
        # int64 accumulators, which so take FOLD times fewer registers (more warps, more loads in flight).
        tile = tl.arange(0, BLOCK // FOLD)[:, None] * FOLD + tl.arange(0, FOLD)[None, :]
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
                    if EVICT:
                        w = tl.load(src_base + s + offs, mask=mask, other=0, eviction_policy="evict_first")
                        tl.store(dst_base + d + offs, w, mask=mask, eviction_policy="evict_first")
                    else:
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
    (checksum.warm_up calls this at a service's start; `legacy` is compiled there already)."""
    cfg = config()
    if cfg.kernel == "legacy":
        return
    a = anchor(device)
    launch(a, a, torch.zeros((1, 4), dtype=torch.int64, device=device), cfg)


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch(src_base: torch.Tensor, dst_base: torch.Tensor, table: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Run every row of `table` (int64 [rows, 4], scatter_rows.rows_of) from int32 `src_base` to int32
    `dst_base` (both 16-byte aligned for the vectorised rows to be fast; any 4-byte alignment is
    correct) and return the rows' word sums, int64 [rows, 2]."""
    from weightsync.bus.scatter_rows import VEC

    rows = table.shape[0]
    partial = torch.empty((max(rows, 1), 2), dtype=torch.int64, device=table.device)
    if rows == 0:
        return partial.zero_()
    grid = rows
    kw = dict(BLOCK=cfg.block, STEPS=cfg.steps, VEC=VEC, FOLD=cfg.fold, EVICT=cfg.evict_first)
    if table.device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1): the CPU tests
        if cfg.per_sm:
            grid = min(rows, cfg.per_sm)
        _kernel()[(grid,)](src_base, dst_base, table, partial, rows, **kw)
        return partial
    if cfg.per_sm:
        grid = min(rows, cfg.per_sm * _sm_count(table.device.index or 0))
    with torch.cuda.device(table.device):
        _kernel()[(grid,)](src_base, dst_base, table, partial, rows, num_warps=cfg.warps, **kw)
    return partial
