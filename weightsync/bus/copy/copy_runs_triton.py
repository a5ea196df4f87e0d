"""Many strided-view copies as one Triton launch over a table of contiguous runs (copy_runs.py).

Each table row is one program's work: (first source element, first destination element, element
count), the element offsets taken from two base pointers that the launch passes. A row whose
offsets and count are multiples of `ALIGN` elements is stored divided by it: the kernel multiplies
back by the constant, so Triton knows every address and the mask are 16-byte aligned and moves
16 bytes per access where a pointer read from memory would otherwise give 2-byte accesses.
Copies between equal dtypes move integer words (bit for bit, NaN payloads included); the one cast,
float32 into bfloat16 (megatron's fp32 norms into a bf16 export), writes what torch's `copy_` writes
on the GPU: compiled, it is the same conversion instruction (to nearest, ties to even, every NaN the
canonical 0x7FFF; a NaN code of our own would make a diverged norm's bytes differ from the per-tensor
export's); under Triton's interpreter, whose float cast truncates, the same result in integers.
"""

from __future__ import annotations

import functools

import torch

from weightsync.triton_support import available  # noqa: F401 (callers ask this module)

BLOCK = 4096  # elements per inner step of one program
STEPS = 16
ROW_ELEMS = BLOCK * STEPS  # at most this many elements per table row (one program)
ALIGN = 8  # elements: 16 bytes of a 2-byte dtype


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_runs(
        table_ptr,
        src_base,
        dst_base,
        BLOCK: tl.constexpr,
        STEPS: tl.constexpr,
        ALIGN: tl.constexpr,
        CAST: tl.constexpr,
        NATIVE: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        s = tl.load(table_ptr + pid * 3) * ALIGN
        d = tl.load(table_ptr + pid * 3 + 1) * ALIGN
        n = tl.load(table_ptr + pid * 3 + 2) * ALIGN
        for i in range(STEPS):  # steps past a short row's end are masked off: no memory traffic
            offs = i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(src_base + s + offs, mask=mask)
            if CAST and NATIVE:  # cvt.rn.bf16.f32, as torch's CUDA copy
                x = x.to(tl.bfloat16).to(tl.int16, bitcast=True)
            elif CAST:  # the interpreter: to nearest with ties to even in integers, NaN canonical
                u = x.to(tl.uint32, bitcast=True)
                h = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
                x = tl.where(x != x, 0x7FFF, h).to(tl.int16, bitcast=True)
            tl.store(dst_base + d + offs, x, mask=mask)

    return copy_runs


def launch(table: torch.Tensor, src_base: torch.Tensor, dst_base: torch.Tensor, align: int) -> None:
    """Run every row of `table` (int64 [rows, 3] on the GPU, offsets in units of `align` elements
    of `src_base` / `dst_base`)."""
    if table.shape[0] == 0:
        return
    grid = (table.shape[0],)
    cast = src_base.dtype != dst_base.dtype  # float32 into bfloat16's int16 words; else equal words
    if table.device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1): the CPU tests
        _kernel()[grid](table, src_base, dst_base, BLOCK=BLOCK, STEPS=STEPS, ALIGN=align, CAST=cast, NATIVE=False)
        return
    with torch.cuda.device(table.device):
        _kernel()[grid](
            table, src_base, dst_base, BLOCK=BLOCK, STEPS=STEPS, ALIGN=align, CAST=cast, NATIVE=True, num_warps=4
        )
