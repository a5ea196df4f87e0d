"""Tiny random HF checkpoints for the Megatron tests (no hub downloads)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
            # 250 is not a multiple of 128*TP, so Megatron pads the vocabulary and export must trim it
            vocab_size=250)
FAMILIES = {
    "qwen2": dict(model_type="qwen2", rope_theta=1e6),
    "llama": dict(model_type="llama", rope_theta=5e5, rms_norm_eps=1e-5),
    "qwen3": dict(model_type="qwen3", head_dim=16, rope_theta=1e6),
    "qwen2-tied": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6),
}


def make_config(family: str, **over):
    from transformers import AutoConfig

    kw = dict(TINY)
    kw.update(FAMILIES[family])
    kw.update(over)
    mt = kw.pop("model_type")
    kw.setdefault("tie_word_embeddings", False)
    return AutoConfig.for_model(mt, **kw)


def save_random_hf(config, out: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            # larger than the default init so a wrong mapping cannot hide behind tiny logits;
            # norms away from 1 so a swapped norm weight shows
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(name="make_config")
def make_config_fixture():
    return make_config


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: save_random_hf(make_config(f), root / f, seed=i) for i, f in enumerate(FAMILIES)}


def torchrun(script: Path, nproc: int, args: list[str], timeout: float, backend_env: dict | None = None):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env.update(backend_env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
