"""Tiny random HF checkpoints for the Megatron tests (no hub downloads), and a torchrun launcher.

Shared by the tests under tests/unit/trainer_svc/actor/megatron/ and the torchrun scripts beside this
module (`SUPPORT / "_dist_roundtrip.py"` ...)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

SUPPORT = Path(__file__).resolve().parent

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    # 250 is not a multiple of 128*TP, so Megatron pads the vocabulary and export must trim it
    vocab_size=250,
)
FAMILIES = {
    "qwen2": dict(model_type="qwen2", rope_theta=1e6),
    "llama": dict(model_type="llama", rope_theta=5e5, rms_norm_eps=1e-5),
    "qwen3": dict(model_type="qwen3", head_dim=16, rope_theta=1e6),
    "qwen2-tied": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6),
}
# MoE families (their own dist test): 4 experts, top-2. qwen3_moe renormalises the top-k weights and
# has one dense layer (mlp_only_layers); qwen2_moe does not renormalise and has a gated shared expert
MOE_FAMILIES = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        head_dim=16,
        rope_theta=1e6,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        rope_theta=1e6,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
    ),
}


def make_config(family: str, **over):
    from transformers import AutoConfig

    kw = dict(TINY)
    kw.update(FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family])
    kw.update(over)
    mt = kw.pop("model_type")
    kw.setdefault("tie_word_embeddings", False)
    return AutoConfig.for_model(mt, **kw)


def save_random_hf(config, out: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            # larger than the default init so a wrong mapping cannot hide behind tiny logits;
            # norms away from 1 so a swapped norm weight shows
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(out))
    return out


# The MTP names as the public loaders read them (written out here, not taken from the code under
# test): DeepSeek-V3 style per vLLM deepseek_mtp.py / SGLang deepseek_nextn.py, MiMo per mimo_mtp.py.
MTP_OWN = {
    "deepseek": (
        "model.layers.{n}.",
        [
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
            "embed_tokens.weight",
            "shared_head.head.weight",
        ],
    ),
    "mimo": (
        "model.mtp_layers.{i}.",
        ["token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight"],
    ),
}


def add_mtp_layers(hf_dir: Path, style: str, depth: int = 1, seed: int = 1) -> Path:
    """Give a saved checkpoint `depth` MTP layers: random own norms/projection, a random copy-shaped
    decoder layer (its tensors named like the last decoder layer's), and for DeepSeek the copies of
    embedding and head; records num_nextn_predict_layers in config.json."""
    import json

    from safetensors.torch import load_file, save_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    n_layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    sd = load_file(str(hf_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n_layers - 1}."
    prefix_fmt, own = MTP_OWN[style]
    for i in range(depth):
        prefix = prefix_fmt.format(n=n_layers + i, i=i)
        for suffix in own:
            if suffix in ("embed_tokens.weight",):
                sd[prefix + suffix] = sd["model.embed_tokens.weight"].clone()
            elif suffix == "shared_head.head.weight":
                sd[prefix + suffix] = sd["lm_head.weight"].clone()
            elif suffix.endswith("proj.weight"):
                sd[prefix + suffix] = torch.randn(hidden, 2 * hidden, generator=g) * 0.2
            else:
                sd[prefix + suffix] = 1.0 + torch.randn(hidden, generator=g) * 0.2
        for name in [k for k in sd if k.startswith(last)]:
            sd[prefix + name[len(last) :]] = torch.randn(sd[name].shape, generator=g) * 0.2
    save_file(sd, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = depth
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return hf_dir


def torchrun(script: Path, nproc: int, args: list[str], timeout: float, backend_env: dict | None = None):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env.update(backend_env or {})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
