"""Block-scaled FP8 (e4m3) weights in the convention of DeepSeek-V3 / Qwen3-FP8 checkpoints.

A weight of shape [..., out, in] travels as two tensors:

- `<name>`           float8_e4m3fn, same shape;
- `<name>_scale_inv` float32, shape [..., ceil(out/128), ceil(in/128)]  (so `X.weight` pairs with
  `X.weight_scale_inv`, the names SGLang's and transformers' FP8 loaders read).

Leading dimensions (a fused experts tensor [experts, out, in]) are independent matrices. For each
128x128 block (edge blocks are partial when a dimension is not a multiple of 128):

    amax = max |w| over the block
    s    = amax / 448                      (float32 division; 448 = largest finite e4m3 value)
    s    = 1   where s < 2**-126           (an all-zero or denormal block: it decodes to zeros)
    q    = e4m3( clamp(float32(w) / s, -448, 448) )   (float32 division, round to nearest even)
    scale_inv[block] = s,   dequantized = float32(q) * s

The name says "inv" because s is the inverse of the factor that maps a block onto the e4m3 range;
checkpoints store exactly this s. Non-finite weights are refused: they would make every weight of
their block NaN on the rollout, silently.

On CUDA a fused Triton kernel (blocks_triton.py) computes the same bytes as the torch path here, bit
for bit (tests/gpu/test_fp8_gpu.py); the torch path runs anywhere and is the reference the unit
tests compare with a from-the-definition implementation.
"""

from __future__ import annotations

import torch

from weightsync.formats.fp8.spec import (  # noqa: F401  (re-exported: the format's names live here too)
    BLOCK,
    BLOCK_FP8,
    FP8_DTYPE,
    FP8_MAX,
    MIN_NORMAL,
    SCALE_DTYPE,
    SCALE_SUFFIX,
    check_supported,
    hf_quantization_config,
)


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def weight_name(scale: str) -> str | None:
    """`X.weight` for `X.weight_scale_inv`, None for a name that is not a scale."""
    return scale[: -len(SCALE_SUFFIX)] if scale.endswith(SCALE_SUFFIX) else None


def is_block_scale(meta, fp8_weights) -> bool:
    """Whether the tensor `meta` (a TensorMeta) is the block scale of one of `fp8_weights` (a set of names)."""
    w = weight_name(meta.name)
    return w is not None and meta.dtype == SCALE_DTYPE and w in fp8_weights


def scale_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    if len(shape) < 2:
        raise ValueError(f"block FP8 needs a matrix (or a stack of them), got shape {list(shape)}")
    *lead, rows, cols = (int(d) for d in shape)
    return (*lead, -(-rows // BLOCK[0]), -(-cols // BLOCK[1]))


def quantize(w: torch.Tensor, name: str = "tensor", check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor, float32 scale_inv) of `w` on `w`'s device; ValueError for inf/nan weights.

    `check_finite=False` leaves that check to the caller (`check_scales`, or export's one
    check per stream): on a GPU the check makes the host wait for the kernel, which a stream of
    many tensors should do once, not per tensor. A non-finite block's scale is then inf or nan.
    """
    if not w.dtype.is_floating_point or w.dtype.itemsize == 1:
        raise ValueError(f"tensor {name}: dtype {w.dtype} cannot be quantized to FP8 (want float32/bfloat16/float16)")
    scale_shape(w.shape)  # validates the rank
    if w.numel() == 0:
        return torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device), torch.ones(
            scale_shape(w.shape), dtype=SCALE_DTYPE, device=w.device
        )
    if w.is_cuda:
        from weightsync.formats.fp8 import blocks_triton  # lazy: triton comes only with CUDA builds of torch

        if blocks_triton.available():
            q, s = blocks_triton.quantize(w)
        else:
            q, s = quantize_torch(w)
    else:
        q, s = quantize_torch(w)
    if check_finite:
        check_scales(s, name)
    return q, s


def check_scales(s: torch.Tensor, name: str = "tensor") -> None:
    """ValueError naming `name` and its first block when a scale is inf or nan (a host sync on a GPU)."""
    if not bool(torch.isfinite(s).all()):
        raise non_finite_error(s, name)


def non_finite_error(s: torch.Tensor, name: str) -> ValueError:
    """The error for a tensor whose scales `s` hold inf or nan: it names the first such block."""
    bad = (~torch.isfinite(s)).nonzero()[0].tolist()
    return ValueError(
        f"tensor {name}: block {bad} holds inf or nan; refusing to export it as FP8 "
        f"(the trainer's weights have diverged)"
    )


def quantize_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch implementation (any device). Non-finite blocks get a non-finite scale."""
    *lead, rows, cols = w.shape
    br, bc = BLOCK
    nr, nc = -(-rows // br), -(-cols // bc)
    x = w.detach().to(torch.float32).reshape(-1, rows, cols)
    # Zero padding leaves every block's amax unchanged; it is cut off again below.
    x = torch.nn.functional.pad(x, (0, nc * bc - cols, 0, nr * br - rows))
    blocks = x.view(-1, nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(2, 4))  # NaN propagates, so a NaN block's scale is NaN
    # Tensor / tensor division: torch turns division by a Python scalar into a multiplication by
    # its float32 reciprocal on CUDA, which is not the correctly rounded quotient.
    s = amax / torch.full_like(amax, FP8_MAX)
    s = torch.where(s < MIN_NORMAL, torch.ones_like(s), s)
    y = blocks / s[:, :, None, :, None]
    q = y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(-1, nr * br, nc * bc)[:, :rows, :cols].reshape(*lead, rows, cols).contiguous()
    return q, s.reshape(*lead, nr, nc)


def dequantize(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32, name: str = "tensor"
) -> torch.Tensor:
    """float32(q) * scale_inv per block (computed in float32), returned in `dtype`."""
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"tensor {name}: dtype {q.dtype}, expected {FP8_DTYPE}")
    want = scale_shape(q.shape)
    if tuple(scale_inv.shape) != want or scale_inv.dtype != SCALE_DTYPE:
        raise ValueError(
            f"tensor {name}{SCALE_SUFFIX}: shape {list(scale_inv.shape)} {scale_inv.dtype}, expected "
            f"{list(want)} {SCALE_DTYPE} for a weight of shape {list(q.shape)}"
        )
    if q.is_cuda and q.numel() and dtype in (torch.float32, torch.bfloat16, torch.float16):
        from weightsync.formats.fp8 import blocks_triton

        if blocks_triton.available():
            return blocks_triton.dequantize(q, scale_inv, dtype)
    return dequantize_torch(q, scale_inv, dtype)


def dequantize_torch(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The torch implementation of `dequantize` (any device; shapes already checked)."""
    *lead, rows, cols = q.shape
    s = scale_inv.to(q.device).repeat_interleave(BLOCK[0], dim=-2).repeat_interleave(BLOCK[1], dim=-1)
    out = q.to(torch.float32) * s[..., :rows, :cols]
    return out.to(dtype)
