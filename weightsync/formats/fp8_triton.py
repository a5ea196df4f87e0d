"""Block FP8 quantization (weightsync.formats.fp8) as fused Triton kernels, for CUDA tensors.

One program per 128x128 block: it reads the block once, reduces its amax, and writes the e4m3
bytes and the block's scale. The result equals the torch path bit for bit (tests/gpu/test_fp8_gpu.py)
because every step is exactly rounded the same way:
- both divisions are IEEE round-to-nearest (`div_rn`), as torch's float32 tensor division is;
- the float32 -> e4m3 rounding is done on the bits here (round to nearest even, e4m3 subnormals by
  the add-a-constant trick), the same arithmetic torch's own cast performs, rather than trusting
  whichever conversion instruction the compiler picks for the GPU at hand;
- denormal float32 intermediates (which the GPU may flush to zero) can only occur where the
  result is a signed zero either way, and a block whose scale would be denormal gets scale 1.
Dequantization is one kernel too (read 1 byte, write the engine's dtype), so a rollout applying FP8
weights does not pay several float32 passes per weight.
Triton ships with CUDA builds of torch, not with the CPU build: callers fall back to the torch
path when `available()` is false.
"""

from __future__ import annotations

import functools

import torch

from weightsync.formats.fp8_spec import BLOCK, FP8_DTYPE, FP8_MAX, MIN_NORMAL
from weightsync.triton_support import available  # noqa: F401 (callers ask this module)


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quant_block(
        x_ptr,
        q_ptr,
        s_ptr,
        rows,
        cols,
        n_rb,
        n_cb,
        BR: tl.constexpr,
        BC: tl.constexpr,
        FMAX: tl.constexpr,
        SMIN: tl.constexpr,
    ):
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
def _dequant_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequant_block(
        q_ptr, s_ptr, out_ptr, rows, cols, n_rb, n_cb, BR: tl.constexpr, BC: tl.constexpr, OUT_BF16: tl.constexpr
    ):
        pid = tl.program_id(0).to(tl.int64)
        per_matrix = n_rb * n_cb
        b = pid // per_matrix
        r = (pid % per_matrix) // n_cb * BR + tl.arange(0, BR).to(tl.int64)
        c = pid % n_cb * BC + tl.arange(0, BC).to(tl.int64)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        offs = b * rows * cols + r[:, None] * cols + c[None, :]
        code = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
        s = tl.load(s_ptr + pid)
        # e4m3fn -> float32 on the bits (exact): normal = 2**(e-7) * 1.m, subnormal = m * 2**-9
        e = (code >> 3) & 0xF
        m = code & 0x7
        normal = ((e + 120) << 23 | m << 20).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        v = tl.where((code & 0x7F) == 0x7F, float("nan"), v)  # e4m3fn's only NaN codes
        # the sign goes on as a bit: Triton's `-v` is `0 - v`, which turns -0.0 into +0.0
        v = (v.to(tl.int32, bitcast=True) | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)
        # one float32 product, one rounding to the output dtype (as float32(q) * s then .to(dtype))
        prod = v * s
        if OUT_BF16:  # round to nearest even on the bits, as torch's float -> bfloat16 does
            bits = prod.to(tl.uint32, bitcast=True)
            half = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(out_ptr + offs, half.to(tl.int16), mask=mask)
        else:
            tl.store(out_ptr + offs, prod.to(out_ptr.dtype.element_ty), mask=mask)

    return dequant_block


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32(q) * scale_inv per block, rounded once to `dtype`, for CUDA tensors (shapes checked
    by the caller). Equals the torch path bit for bit (tests/gpu/test_fp8_gpu.py)."""
    codes = q.contiguous().view(torch.uint8)
    s = scale_inv.to(device=q.device, dtype=torch.float32).contiguous()
    *lead, rows, cols = q.shape
    n_rb, n_cb = s.shape[-2:]
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    bf16 = dtype == torch.bfloat16
    with torch.cuda.device(q.device):
        _dequant_kernel()[(s.numel(),)](
            codes,
            s,
            out.view(torch.int16) if bf16 else out,
            rows,
            cols,
            n_rb,
            n_cb,
            BR=BLOCK[0],
            BC=BLOCK[1],
            OUT_BF16=bf16,
            num_warps=8,
        )
    return out


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3, float32 scale_inv) of a CUDA tensor of rank >= 2; a non-finite block's scale is inf."""
    x = w.detach().contiguous()
    *lead, rows, cols = x.shape
    n_rb, n_cb = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    s = torch.empty((*lead, n_rb, n_cb), dtype=torch.float32, device=x.device)
    programs = s.numel()
    with torch.cuda.device(x.device):
        _kernel()[(programs,)](
            x, q, s, rows, cols, n_rb, n_cb, BR=BLOCK[0], BC=BLOCK[1], FMAX=FP8_MAX, SMIN=MIN_NORMAL, num_warps=8
        )
    return q.view(FP8_DTYPE), s
