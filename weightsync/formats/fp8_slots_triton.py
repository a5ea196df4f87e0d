"""Block FP8 quantization straight into bucket slots: one Triton launch per bucket (fp8_slots.py).

The per-tensor quantizer (fp8_triton.py) takes a contiguous tensor and returns new ones, which the
pipeline then copies into a bucket: one launch per weight plus a pack copy. Here one program still
owns one 128x128 block, but its rows are read through a per-row table of source offsets (so a
weight may be any set of contiguous rows of a parameter: Megatron's query-group interleaved QKV,
the gate/up halves of linear_fc1) and its e4m3 bytes and scale are stored at their byte offsets
in the bucket. Which tensor a program belongs to comes from a per-program table of tensor indices.

The arithmetic is fp8_triton.quant_block's, line for line (tests compare the bytes with the torch
reference, fp8.quantize_torch, which tests/gpu/test_fp8_gpu.py holds the per-tensor kernel to):
IEEE divisions (`div_rn`) and the float32 -> e4m3 rounding done on the bits. A block whose scale
is not finite (an inf or nan weight) raises a device flag instead of making the host wait per
tensor: the caller reads it once per sync.
"""

from __future__ import annotations

import functools

import torch

from weightsync.formats.fp8_spec import BLOCK, FP8_MAX, MIN_NORMAL
from weightsync.triton_support import available  # noqa: F401 (callers ask this module)

#: int64 fields per row of the tensor table: rows, cols, e4m3 byte offset, scale word offset,
#: first row in the row table, first program
TENSOR_FIELDS = 6


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quant_slots(
        src_base,
        row_ptr,
        tensor_ptr,
        owner_ptr,
        q_base,
        s_base,
        flag_ptr,
        BR: tl.constexpr,
        BC: tl.constexpr,
        FMAX: tl.constexpr,
        SMIN: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        t = tl.load(owner_ptr + pid).to(tl.int64) * 6
        rows = tl.load(tensor_ptr + t)
        cols = tl.load(tensor_ptr + t + 1)
        q_off = tl.load(tensor_ptr + t + 2)
        s_off = tl.load(tensor_ptr + t + 3)
        row0 = tl.load(tensor_ptr + t + 4)
        k = pid - tl.load(tensor_ptr + t + 5)  # this block's index in its tensor (row-major)
        n_cb = (cols + BC - 1) // BC
        r = (k // n_cb) * BR + tl.arange(0, BR).to(tl.int64)
        c = (k % n_cb) * BC + tl.arange(0, BC).to(tl.int64)
        rmask = r < rows
        mask = rmask[:, None] & (c[None, :] < cols)
        src = tl.load(row_ptr + row0 + r, mask=rmask, other=0)  # each row's first element in src_base
        x = tl.load(src_base + src[:, None] + c[None, :], mask=mask, other=0.0).to(tl.float32)
        # from here to the stores: fp8_triton.quant_block's arithmetic
        a = tl.where(x == x, tl.abs(x), float("inf"))  # a NaN makes the block's scale inf: refused
        amax = tl.max(tl.max(a, axis=1), axis=0)
        s = tl.div_rn(amax, FMAX)
        s = tl.where(s < SMIN, 1.0, s)
        y = tl.div_rn(x, s)
        y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
        bits = y.to(tl.int32, bitcast=True)
        sign = ((bits >> 31) & 1) << 7
        mag = bits & 0x7FFFFFFF
        odd = (mag >> 20) & 1
        normal = ((mag + 0x7FFFF + odd) >> 20) - ((127 - 7) << 3)
        t32 = tl.abs(y) * 512.0 + 8388608.0
        sub = t32.to(tl.int32, bitcast=True) - 0x4B000000
        code = tl.where(mag < (121 << 23), sub, normal) | sign
        tl.store(q_base + q_off + r[:, None] * cols + c[None, :], code.to(tl.uint8), mask=mask)
        tl.store(s_base + s_off + k, s)
        tl.atomic_max(flag_ptr, 1, mask=s == float("inf"))  # only a diverged block touches the flag

    return quant_slots


def launch(
    src_base: torch.Tensor,
    rows: torch.Tensor,
    tensors: torch.Tensor,
    owners: torch.Tensor,
    q_base: torch.Tensor,
    s_base: torch.Tensor,
    flag: torch.Tensor,
) -> None:
    """Quantize every block `owners` names (int32, one per program) from `src_base` (offsets in
    `rows`, int64 elements) into `q_base` (uint8) and `s_base` (float32 words of the same buffer);
    `flag` (int32 [1]) becomes 1 where a block is not finite."""
    grid = (owners.numel(),)
    if grid[0] == 0:
        return
    args = (src_base, rows, tensors, owners, q_base, s_base, flag)
    consts = dict(BR=BLOCK[0], BC=BLOCK[1], FMAX=FP8_MAX, SMIN=MIN_NORMAL)
    if owners.device.type != "cuda":  # Triton's interpreter (TRITON_INTERPRET=1): the CPU tests
        _kernel()[grid](*args, **consts)
        return
    with torch.cuda.device(owners.device):
        _kernel()[grid](*args, **consts, num_warps=8)
