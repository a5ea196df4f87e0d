"""Model sources both services accept: a local HF directory or a built-in tiny config name.

The tiny configs let the demo and the tests run real transformers / megatron-core models on a
CPU in seconds without any hub download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# What every tiny config shares: 2 layers, GQA 4/2 heads, 64 wide, 256 tokens.
_TINY_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)

TINY = {
    "tiny-qwen2": dict(_TINY_BASE, model_type="qwen2"),
    "tiny-qwen2-tied": dict(_TINY_BASE, model_type="qwen2", tie_word_embeddings=True),
    "tiny-llama": dict(_TINY_BASE, model_type="llama", rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny-qwen3": dict(_TINY_BASE, model_type="qwen3", head_dim=16),
    # 4 experts, top-2 (renormalised, as Qwen3-MoE ships), no shared expert
    "tiny-qwen3-moe": dict(_TINY_BASE, **_MOE, model_type="qwen3_moe", norm_topk_prob=True, head_dim=16),
    # Qwen2-MoE: routed experts plus a sigmoid-gated shared expert
    "tiny-qwen2-moe": dict(_TINY_BASE, **_MOE, model_type="qwen2_moe", shared_expert_intermediate_size=48),
}


def resolve_model(spec: str, field_name: str = "model") -> tuple[Any, str | None]:
    """Return (transformers config, local weights dir or None) for a --model value."""
    from transformers import AutoConfig

    if spec in TINY:
        kw = dict(TINY[spec])
        model_type = kw.pop("model_type")
        return AutoConfig.for_model(model_type, **kw), None
    path = Path(spec)
    if (path / "config.json").is_file():
        cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
        has_weights = any(path.glob("*.safetensors"))
        return cfg, (str(path) if has_weights else None)
    raise ValueError(
        f"{field_name}={spec!r} is neither a local HF directory with config.json nor one of {sorted(TINY)}"
    )
