"""Which exported tensors travel as block FP8, and the trainer's exported stream in that format.

The rule follows what DeepSeek-V3, Kimi-K2 and the Qwen3-FP8 checkpoints do: every linear
projection weight of attention and MLP (dense, routed experts, shared experts) is FP8; embeddings,
lm_head, norms, biases, the MoE router (`mlp.gate.weight`) and Qwen2-MoE's `shared_expert_gate`
stay in 16 bits. A name the table does not list stays in 16 bits too: an unknown tensor sent
unquantized costs bytes, one quantized wrongly costs accuracy.

Each quantized `X` becomes `X_scale_inv` (float32) followed by `X` (e4m3): the scale first, so a
receiver that dequantizes holds at most one small scale while waiting for its weight, even when
the two land in different buckets.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from weightsync.bus.plan import TensorMeta
from weightsync.formats.fp8 import FP8_DTYPE, SCALE_DTYPE, quantize, scale_name, scale_shape

#: HF names of linear weights (checkpoint names, and transformers 5's fused in-memory experts)
QUANTIZED_PATTERNS: tuple[re.Pattern, ...] = tuple(re.compile(p) for p in (
    r"\.self_attn\.(q|k|v|o)_proj\.weight$",
    r"\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$",   # DeepSeek MLA
    r"\.mlp\.(gate|up|down)_proj\.weight$",                                       # dense MLP
    r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$",                         # routed experts
    r"\.mlp\.shared_experts?\.(gate|up|down)_proj\.weight$",                      # shared expert(s)
    r"\.mlp\.experts\.(gate_up_proj|down_proj)$",                                 # fused [E, out, in]
))


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """True when `name` (an HF tensor name) is exported as block FP8."""
    return len(shape) >= 2 and any(p.search(name) for p in QUANTIZED_PATTERNS)


def export_metas(metas: Iterable[TensorMeta], keep_dtype: torch.dtype = torch.bfloat16) -> list[TensorMeta]:
    """The manifest entries of `metas` exported as block FP8 (order = `export_tensors`' order)."""
    out: list[TensorMeta] = []
    for m in metas:
        if is_quantized(m.name, m.shape):
            out.append(TensorMeta(scale_name(m.name), scale_shape(m.shape), SCALE_DTYPE))
            out.append(TensorMeta(m.name, m.shape, FP8_DTYPE))
        else:
            out.append(TensorMeta(m.name, m.shape, keep_dtype))
    return out


def export_tensors(named: Iterable[tuple[str, torch.Tensor]],
                   keep_dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """Map an actor's (HF name, tensor) stream onto the block FP8 stream `export_metas` describes.

    Quantizes on the tensor's own device (the Triton kernel on CUDA), one tensor at a time, so
    memory stays bounded by the largest tensor as in the plain export.
    """
    for name, t in named:
        if is_quantized(name, tuple(t.shape)):
            q, s = quantize(t, name)
            yield scale_name(name), s
            yield name, q
        else:
            yield name, t.detach().to(keep_dtype)
