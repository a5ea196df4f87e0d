"""Tiny transformers configs for the built-in engine: fast on 2 CPU cores, no hub downloads."""

from __future__ import annotations

import pytest
import torch

from rollout_svc.engine.builtin import BuiltinEngine

torch.set_num_threads(2)


# What both families share (no eos/bos: generation runs to max_new_tokens unless a test sets one).
_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
)


def _config(model_type: str, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**_BASE, **kw})


def qwen2_config(**kw):
    return _config("qwen2", **{"num_key_value_heads": 2, **kw})  # GQA


def llama_config(**kw):
    return _config("llama", **{"num_key_value_heads": 4, **kw})  # MHA


CONFIGS = {
    "qwen2": qwen2_config,
    "llama": llama_config,
    "qwen2_tied": lambda: qwen2_config(tie_word_embeddings=True),
}


@pytest.fixture(params=sorted(CONFIGS))
def engine(request) -> BuiltinEngine:
    return BuiltinEngine.from_config(CONFIGS[request.param](), seed=0)


@pytest.fixture
def qwen() -> BuiltinEngine:
    return BuiltinEngine.from_config(qwen2_config(), seed=0)
