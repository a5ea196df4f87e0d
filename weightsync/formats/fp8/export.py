"""Which exported tensors travel as block FP8, and the trainer's exported stream in that format.

The rule follows what DeepSeek-V3, Kimi-K2 and the Qwen3-FP8 checkpoints do: every linear
projection weight of attention and MLP (dense, routed experts, shared experts) is FP8; embeddings,
lm_head, norms, biases, the MoE router (`mlp.gate.weight`) and Qwen2-MoE's `shared_expert_gate`
stay in 16 bits. A name the table does not list stays in 16 bits too: an unknown tensor sent
unquantized costs bytes, one quantized wrongly costs accuracy.

Each quantized `X` becomes `X_scale_inv` (float32) followed by `X` (e4m3): the scale first, so a
receiver that dequantizes holds at most one small scale while waiting for its weight, even when
the two land in different buckets.

Non-finite weights are refused once per stream, after its last tensor (`FiniteScales`), not per
tensor: a per-tensor check makes the host wait for each quantization kernel, which stalls the
GPU between every weight of a sync.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

import torch

from weightsync.bus.plan import TensorMeta, fast_meta
from weightsync.formats.fp8.blocks import FP8_DTYPE, SCALE_DTYPE, non_finite_error, quantize, scale_name, scale_shape

#: HF names of linear weights (checkpoint names, and transformers 5's fused in-memory experts)
QUANTIZED_PATTERNS: tuple[re.Pattern, ...] = tuple(
    re.compile(p)
    for p in (
        r"\.self_attn\.(q|k|v|o)_proj\.weight$",
        r"\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$",  # DeepSeek MLA
        r"\.mlp\.(gate|up|down)_proj\.weight$",  # dense MLP
        r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$",  # routed experts
        r"\.mlp\.shared_experts?\.(gate|up|down)_proj\.weight$",  # shared expert(s)
        r"\.mlp\.experts\.(gate_up_proj|down_proj)$",  # fused [E, out, in]
    )
)


# the patterns as one: a manifest asks this of every tensor (140,000 for Kimi-K2)
_ANY_QUANTIZED = re.compile("|".join(f"(?:{p.pattern})" for p in QUANTIZED_PATTERNS))


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """True when `name` (an HF tensor name) is exported as block FP8."""
    return len(shape) >= 2 and _ANY_QUANTIZED.search(name) is not None


def export_metas(metas: Iterable[TensorMeta], keep_dtype: torch.dtype = torch.bfloat16) -> list[TensorMeta]:
    """The manifest entries of `metas` exported as block FP8 (order = `export_tensors`' order)."""
    out: list[TensorMeta] = []
    scales: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}  # shape -> its scale's shape, nbytes
    for m in metas:
        if is_quantized(m.name, m.shape):
            shape = tuple(m.shape)
            got = scales.get(shape)
            if got is None:
                s = scale_shape(shape)
                got = scales[shape] = (s, 4 * math.prod(s))
            out.append(fast_meta(scale_name(m.name), got[0], SCALE_DTYPE, got[1]))
            out.append(fast_meta(m.name, shape, FP8_DTYPE, math.prod(shape)))  # e4m3: 1 byte per element
        else:
            out.append(TensorMeta(m.name, m.shape, keep_dtype))
    return out


class FiniteScales:
    """The scales of one exported stream, checked for inf/nan all at once at its end.

    A block's scale is inf or nan exactly when the block holds an inf or nan weight, so checking
    the scales checks the weights. Holding on to every scale until the end costs 4 bytes per
    128x128 block (about 2 MB for a 7B model); the check is one reduction and one host
    synchronisation per device. Only a diverged model pays a per-tensor search, to name the first
    bad tensor and block in the error.
    """

    def __init__(self):
        self._scales: list[tuple[str, torch.Tensor]] = []

    def add(self, name: str, s: torch.Tensor) -> None:
        self._scales.append((name, s))

    def check(self) -> None:
        """ValueError naming the first tensor (in stream order) and block whose scale is inf or nan."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, s in self._scales:
            by_device.setdefault(s.device, []).append(s.reshape(-1))
        if all(_all_finite(torch.cat(flat)) for flat in by_device.values()):
            return
        name, s = next((name, s) for name, s in self._scales if not _all_finite(s))
        raise non_finite_error(s, name)


def _all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())  # the host synchronisation


def export_tensors(
    named: Iterable[tuple[str, torch.Tensor]], keep_dtype: torch.dtype = torch.bfloat16
) -> Iterator[tuple[str, torch.Tensor]]:
    """Map an actor's (HF name, tensor) stream onto the block FP8 stream `export_metas` describes.

    Quantizes on the tensor's own device (the Triton kernel on CUDA), one tensor at a time, so
    memory stays bounded by the largest tensor as in the plain export.

    A non-finite weight raises ValueError (naming the first such tensor and block) only after the
    last tensor has been yielded: a consumer must read the stream to its end before it commits
    or publishes anything it wrote. The sync's pipeline does (weightsync/bus/pipeline.py asks for
    one tensor past the manifest before it finishes), and so does ExportHf (trainer_svc/export_hf.py).
    """
    scales = FiniteScales()
    for name, t in named:
        if is_quantized(name, tuple(t.shape)):
            q, s = quantize(t, name, check_finite=False)
            scales.add(name, s)
            yield scale_name(name), s
            yield name, q
        else:
            yield name, t.detach().to(keep_dtype)
    scales.check()
