"""Block FP8 quantization (weightsync.formats.fp8.blocks) as fused Triton kernels, for CUDA tensors.

One program per 128x128 block: it reads the block once, reduces its amax, and writes the e4m3
bytes and the block's scale. The result equals the torch path bit for bit (tests/gpu/test_fp8_gpu.py)
because every step is exactly rounded the same way:
- both divisions are IEEE round-to-nearest (`div_rn`), as torch's float32 tensor division is;
- the float32 -> e4m3 rounding is done on the bits (quantize_triton.py: round to nearest even, e4m3 subnormals by
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

import torch

from weightsync.formats.fp8.spec import BLOCK, FP8_DTYPE, FP8_MAX, MIN_NORMAL
from weightsync.triton_support import available  # noqa: F401 (callers ask this module)


def _kernel():
    from weightsync.formats.fp8.quantize_triton import quant_block

    return quant_block


def _dequant_kernel():
    from weightsync.formats.fp8.dequantize_triton import dequant_block

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
