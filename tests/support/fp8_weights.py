"""Weights that exercise block-FP8 quantization's edge cases, shared by its CPU and GPU tests."""

from __future__ import annotations

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
