"""The Triton kernel of a block-FP8 sync that the trainer writes into the engine (write_slots.py): each
128x128 block quantized and dequantized in registers, the dequantized values stored into the engine's
parameter, the e4m3 codes and the scale only summed.

It calls the quantizer's block amax, scale, rounding and word sums (`block_amax`, `scale_of`,
`e4m3_codes`, `code_word_sums`, quantize_triton.py) and the dequantizer's decode and rounding
(`from_e4m3`, `bf16_bits`, dequantize_triton.py), so what it stores is bit for bit what
quantizing (quant_slots) and then dequantizing (dequant_bucket) the same weights store, and its word
sums are quant_slots'. CVT (constexpr): both roundings by the GPU's conversions (sm_89+), else on the
bits (quantize_slots_triton.gpu_conversions).

Imported only by write_slots.py, lazily: triton comes with CUDA builds of torch, not the CPU build.
The helpers are imported as module globals because a `@triton.jit` function resolves the functions it
calls among its module's globals (compiled, and under the CPU interpreter alike).
"""

from __future__ import annotations

import triton
import triton.language as tl

from weightsync.formats.fp8.dequantize_triton import bf16_bits, from_e4m3
from weightsync.formats.fp8.quantize_triton import (
    block_amax,
    block_columns,
    code_word_sums,
    e4m3_codes,
    scale_of,
    source_tile,
)


@triton.jit
def write_slots(
    src_base,
    row_ptr,
    tensor_ptr,
    owner_ptr,
    bf16_base,
    f32_base,
    flag_ptr,
    sums_ptr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    RB: tl.constexpr,
    FMAX: tl.constexpr,
    SMIN: tl.constexpr,
    VEC: tl.constexpr,
    CVT: tl.constexpr,
):
    """One program per block: block k (row-major) of the weight that owns it, RB rows at a time in two
    passes as quant_slots: the block's amax, then per tile the codes, their dequantized values (stored
    at element `d_off` of the destination base of the parameter's dtype) and their word sums.
    VEC (constexpr): what every weight's columns, destination offset and source row offsets in the
    launch are multiples of (a multiple of 4: the sums need rows of whole words), multiplied back in
    so the compiler can see it."""
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(owner_ptr + pid).to(tl.int64) * 6
    rows = tl.load(tensor_ptr + t)
    cols = tl.load(tensor_ptr + t + 1)
    d_off = (tl.load(tensor_ptr + t + 2) // VEC) * VEC
    row0 = tl.load(tensor_ptr + t + 3)
    k = pid - tl.load(tensor_ptr + t + 4)  # this block's index in its matrix (row-major)
    out_f32 = tl.load(tensor_ptr + t + 5)
    cols, r0, c, cmask = block_columns(cols, k, BR, BC, VEC)
    s = scale_of(block_amax(src_base, row_ptr, row0, r0, c, cmask, rows, BR, RB, VEC), FMAX, SMIN)
    s1 = tl.zeros([RB], dtype=tl.int64)
    s2 = tl.zeros([RB], dtype=tl.int64)
    for i in range(BR // RB):
        r, mask, x = source_tile(src_base, row_ptr, row0, r0, i, rows, c, cmask, RB, VEC)
        code = e4m3_codes(x, s, FMAX, CVT)
        prod = from_e4m3(code.to(tl.uint8)) * s  # dequant_tile's product, rounded once below
        offs = d_off + r[:, None] * cols + c[None, :]
        if out_f32 != 0:
            tl.store(f32_base + offs, prod, mask=mask)
        else:
            tl.store(bf16_base + offs, bf16_bits(prod, CVT), mask=mask)
        t1, t2 = code_word_sums(code, RB, BC)  # quant_slots' SUMS: the e4m3 words it would have written
        s1 += t1
        s2 += t2
    tl.atomic_max(flag_ptr, 1, mask=s == float("inf"))  # only a diverged block touches the flag
    tl.store(sums_ptr + pid * 4, tl.sum(s1, axis=0))
    tl.store(sums_ptr + pid * 4 + 1, tl.sum(s2, axis=0))
    sw = s.to(tl.int32, bitcast=True)  # the scale's own word, in whichever bucket holds its slot
    tl.store(sums_ptr + pid * 4 + 2, sw.to(tl.int64))
    tl.store(sums_ptr + pid * 4 + 3, (sw * sw).to(tl.int64))
