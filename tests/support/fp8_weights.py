"""Weights that exercise block-FP8 quantization's edge cases, shared by its CPU and GPU tests."""

from __future__ import annotations

import math

import torch


def block_test_weights(shape, kind: str, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random weights of `shape` in `dtype`, by `kind`: "randn" (0.02 scale), "heavy" (log-normal tails
    spanning many binades), "zeros" (an all-zero block, a -0.0, and where there are > 128 rows a block
    of fp32 denormals — zero in bf16 — whose scale falls below MIN_NORMAL) or "huge" (near the dtype's
    top: an overflow-free scale must still come out)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    if kind == "heavy":
        w = w * torch.exp(torch.randn(shape, generator=g) * 4)
    elif kind == "zeros":
        w[..., :128, :128] = 0
        w[..., 0, -1] = -0.0
        if shape[-2] > 128:
            w[..., 128:256, :128] = 1e-40
    elif kind == "huge":
        w = w * (1e36 if dtype == torch.float32 else 1e30)
    return w.to(dtype)


def bucket_layout(shapes, start: int = 0) -> tuple[list[tuple[int, int]], int]:
    """(scale offset, e4m3 offset) per weight of `shapes` in one bucket from byte `start`, 256-aligned
    as bucket plans are, and the bucket's size (3 spare bytes: a tail that is not a whole word)."""
    from weightsync.formats.fp8 import blocks as fp8

    places, pos = [], start
    for shape in shapes:
        s_off = -(-pos // 256) * 256
        q_off = -(-(s_off + 4 * math.prod(fp8.scale_shape(shape))) // 256) * 256
        places.append((s_off, q_off))
        pos = q_off + math.prod(shape)
    return places, pos + 3
