"""The Triton kernels of scatter_triton.py: copy-and-checksum over a table of rows, in two forms that
share one row loop (`_rows`) and differ only in how many inner steps a row runs.

Imported only by scatter_triton.py, lazily: triton comes with CUDA builds of torch, not the CPU build.
The helpers are module globals because a `@triton.jit` function resolves the functions it calls among
its module's globals (compiled, and under the CPU interpreter alike).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _copy_sum(
    src_base, dst_base, s, d, n, tile, copy, acc1, acc2, BLOCK: tl.constexpr, STEPS: tl.constexpr, SHORT: tl.constexpr
):
    """`acc1`, `acc2` plus the word sums of `n` words from word `s` of src_base (copied to word `d` of
    dst_base where `copy`). SHORT: the loop runs over the row's own steps only, else over a fixed STEPS."""
    n_steps = tl.cdiv(n, BLOCK) if SHORT else STEPS
    for i in range(n_steps):
        offs = i * BLOCK + tile
        mask = offs < n
        w = tl.load(src_base + s + offs, mask=mask, other=0)
        if copy:
            tl.store(dst_base + d + offs, w, mask=mask)
        acc1 += tl.sum(w.to(tl.int64), axis=1)
        acc2 += tl.sum((w * w).to(tl.int64), axis=1)  # the square wraps in int32, as on the CPU path
    return acc1, acc2


@triton.jit
def _rows(
    src_base,
    dst_base,
    table_ptr,
    out_ptr,
    n_rows,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
    VEC: tl.constexpr,
    FOLD: tl.constexpr,
    SHORT: tl.constexpr,
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
            acc1, acc2 = _copy_sum(
                src_base, dst_base, s * VEC, d * VEC, n * VEC, tile, True, acc1, acc2, BLOCK, STEPS, SHORT
            )
        else:
            acc1, acc2 = _copy_sum(src_base, dst_base, s, d, n, tile, kind == 2, acc1, acc2, BLOCK, STEPS, SHORT)
        tl.store(out_ptr + r * 2, tl.sum(acc1, axis=0))
        tl.store(out_ptr + r * 2 + 1, tl.sum(acc2, axis=0))


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
    """Rows of at most BLOCK * STEPS words, each running all STEPS inner steps (masked past its end)."""
    _rows(src_base, dst_base, table_ptr, out_ptr, n_rows, BLOCK, STEPS, VEC, FOLD, False)


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
    """The same rows, each running only its own steps (STEPS unused: the launch passes one config's fields)."""
    _rows(src_base, dst_base, table_ptr, out_ptr, n_rows, BLOCK, STEPS, VEC, FOLD, True)
