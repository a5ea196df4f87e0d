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
    """The aligned-row kernel (scatter_kernels.scatter_sum64_vec): every row runs the config's STEPS."""
    from weightsync.bus.copy import scatter_kernels  # lazy: triton comes only with CUDA builds of torch

    return scatter_kernels.scatter_sum64_vec


@functools.lru_cache(maxsize=1)
def _short_kernel():
    """The same rows, for tables of many rows far shorter than a row's most words (a TP rank's column
    shard: one row per source row, e.g. 896 words at 7B): the inner loop runs only over the row's own
    steps, where the aligned-row kernel's fixed STEPS would spend most iterations masked. A separate
    kernel, so the aligned-row kernel of the plain path is compiled exactly as before."""
    from weightsync.bus.copy import scatter_kernels

    return scatter_kernels.scatter_sum64_short


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
