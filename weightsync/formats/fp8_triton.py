"""Block FP8 quantization (weightsync.formats.fp8) as one fused Triton kernel, for CUDA tensors.

One program per 128x128 block: it reads the block once, reduces its amax, and writes the e4m3
bytes and the block's scale. The result equals the torch path bit for bit (tests/gpu/test_fp8_gpu.py)
because every step is exactly rounded the same way:
- both divisions are IEEE round-to-nearest (`div_rn`), as torch's float32 tensor division is;
- the float32 -> e4m3 rounding is done on the bits here (round to nearest even, e4m3 subnormals by
  the add-a-constant trick), the same arithmetic torch's own cast performs, rather than trusting
  whichever conversion instruction the compiler picks for the GPU at hand;
- denormal float32 intermediates (which the GPU may flush to zero) can only occur where the
  result is a signed zero either way, and a block whose scale would be denormal gets scale 1.
Triton ships with CUDA builds of torch, not with the CPU build: callers fall back to the torch
path when `available()` is false.
"""
from __future__ import annotations

import functools

import torch

from weightsync.formats.fp8 import BLOCK, FP8_DTYPE, FP8_MAX, MIN_NORMAL


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quant_block(x_ptr, q_ptr, s_ptr, rows, cols, n_rb, n_cb,
                    BR: tl.constexpr, BC: tl.constexpr, FMAX: tl.constexpr, SMIN: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        per_matrix = n_rb * n_cb
        b = pid // per_matrix
        rb = (pid % per_matrix) // n_cb
        cb = pid % n_cb
        r = rb * BR + tl.arange(0, BR).to(tl.int64)
        c = cb * BC + tl.arange(0, BC).to(tl.int64)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        offs = b * rows * cols + r[:, None] * cols + c[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.where(x == x, tl.abs(x), float("inf"))  # a NaN makes the block's scale inf: refused
        amax = tl.max(tl.max(a, axis=1), axis=0)
        s = tl.div_rn(amax, FMAX)
        s = tl.where(s < SMIN, 1.0, s)
        y = tl.div_rn(x, s)
        y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
        # float32 -> e4m3fn, round to nearest even, on the bits (|y| <= 448: no overflow case left)
        bits = y.to(tl.int32, bitcast=True)
        sign = ((bits >> 31) & 1) << 7
        mag = bits & 0x7FFFFFFF
        # normal e4m3 (|y| >= 2**-6): drop 20 mantissa bits with RNE, then rebias 127 -> 7
        odd = (mag >> 20) & 1
        normal = ((mag + 0x7FFFF + odd) >> 20) - ((127 - 7) << 3)
        # subnormal e4m3 (|y| < 2**-6, steps of 2**-9): |y| * 512 rounded to an integer in 0..8 by
        # adding 2**23 (a float32 add rounds to nearest even); 8 is the smallest normal code
        t = tl.abs(y) * 512.0 + 8388608.0
        sub = t.to(tl.int32, bitcast=True) - 0x4B000000
        code = tl.where(mag < (121 << 23), sub, normal) | sign
        tl.store(q_ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(s_ptr + pid, s)

    return quant_block


@functools.lru_cache(maxsize=1)
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3, float32 scale_inv) of a CUDA tensor of rank >= 2; a non-finite block's scale is inf."""
    x = w.detach().contiguous()
    *lead, rows, cols = x.shape
    n_rb, n_cb = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    s = torch.empty((*lead, n_rb, n_cb), dtype=torch.float32, device=x.device)
    programs = s.numel()
    with torch.cuda.device(x.device):
        _kernel()[(programs,)](x, q, s, rows, cols, n_rb, n_cb, BR=BLOCK[0], BC=BLOCK[1], FMAX=FP8_MAX,
                               SMIN=MIN_NORMAL, num_warps=8)
    return q.view(FP8_DTYPE), s
