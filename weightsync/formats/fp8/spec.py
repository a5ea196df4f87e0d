"""The block FP8 scheme as data: its constants and how a manifest / an HF config names it.

Shared by the torch path (blocks.py) and the Triton kernels (blocks_triton.py), which import nothing
of each other's module.
"""

from __future__ import annotations

import torch

from weightsync.bus.plan import Quantization

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
FP8_MAX = 448.0
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
#: smallest normal float32; a block scale below it is replaced by 1 (see blocks.py)
MIN_NORMAL = 2.0**-126
#: what a manifest announces for it
BLOCK_FP8 = Quantization(method="fp8", fmt="e4m3", weight_block_size=BLOCK)


def hf_quantization_config(q: Quantization = BLOCK_FP8) -> dict:
    """The `quantization_config` of an HF config.json for `q` (DeepSeek-V3 / Qwen3-FP8 spelling)."""
    return {
        "quant_method": q.method,
        "fmt": q.fmt,
        "activation_scheme": "dynamic",
        "weight_block_size": list(q.weight_block_size),
    }


def check_supported(q: Quantization) -> None:
    """The only variant both ends implement; anything else is refused by name."""
    if q != BLOCK_FP8:
        raise ValueError(
            f"quantization method={q.method!r} fmt={q.fmt!r} weight_block_size="
            f"{list(q.weight_block_size)} is not supported; this build handles fp8 / e4m3 / "
            f"[128, 128] only"
        )
