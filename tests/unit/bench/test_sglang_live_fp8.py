"""bench/sglang_live.py `--timing-dtype fp8-block` (bench/sglang_fleet.py `save_random_fp8`): the block-FP8
checkpoint SGLang is started from holds what the
trainer's fp8-block sync carries (names, dtypes, scale shapes) and declares the scheme SGLang serves as block FP8."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from rollout_svc.engine.sglang_engine import _hf_param_metas
from rollout_svc.engine.sglang_fp8 import served_metas, serves_block_fp8
from weightsync.bus.plan import TensorMeta
from weightsync.formats.fp8.blocks import dequantize
from weightsync.formats.fp8.export import export_metas


def test_save_random_fp8_writes_the_checkpoint_sglang_serves_as_block_fp8(tmp_path):
    from bench.sglang_fleet import save_random_fp8

    cfg = AutoConfig.for_model(
        "qwen2",
        vocab_size=320,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    out = save_random_fp8(tmp_path / "bf16", tmp_path / "fp8", device="cpu")
    (shard,) = sorted(out.glob("*.safetensors"))
    got = load_file(shard)
    bf16 = {}
    for f in (tmp_path / "bf16").glob("*.safetensors"):
        bf16.update(load_file(f))
    want = export_metas([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in bf16.items()])
    assert {n: (tuple(t.shape), t.dtype) for n, t in got.items()} == {m.name: (tuple(m.shape), m.dtype) for m in want}
    config = AutoConfig.from_pretrained(out)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    assert serves_block_fp8(config)
    fp8 = {
        n
        for n, m in served_metas(_hf_param_metas(config, torch.bfloat16), config).items()
        if m.dtype == torch.float8_e4m3fn
    }
    assert fp8 == {n for n, t in got.items() if t.dtype == torch.float8_e4m3fn} and len(fp8) == 7
    name = "model.layers.0.mlp.down_proj.weight"
    back = dequantize(got[name], got[name + "_scale_inv"], torch.float32)
    ref = bf16[name].float()
    assert (back - ref).norm() / ref.norm() < 0.07  # e4m3's 3 mantissa bits: ~0.03 relative L2 error
    assert torch.equal(got["model.embed_tokens.weight"], bf16["model.embed_tokens.weight"])
