"""Block-FP8 syncs into an SGLang serving a block-FP8 checkpoint: what the engine declares it holds in FP8
(rollout_svc/engine/sglang_fp8.py), the block alignment checked before SGLang starts, and the prepare's
refusals (rollout_svc/quantized.py) through the real transaction. SGLang's own layers are exercised by
tests/sglang_exec/fp8_checks.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from rollout_svc.engine.sglang_engine import SglangEngine, _hf_param_metas
from rollout_svc.engine.sglang_fp8 import check_block_aligned, served_metas, serves_block_fp8
from rollout_svc.sync.transaction import SyncError, SyncTransaction
from weightsync.bus.copy.checksum import ALGO
from weightsync.bus.plan import TensorMeta, make_manifest
from weightsync.formats.fp8.export import export_metas
from weightsync.formats.fp8.spec import BLOCK_FP8, FP8_DTYPE, hf_quantization_config

#: Qwen2.5-7B and -1.5B shapes (hidden, intermediate, heads, kv heads); two layers are enough: every layer is alike
QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4)
QWEN2_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2)
TINY_FP8 = dict(hidden_size=256, intermediate_size=384, num_attention_heads=2, num_key_value_heads=1)


def _config(quantized: bool = True, **shape):
    kw = dict(vocab_size=512, num_hidden_layers=2, max_position_embeddings=64, **shape)
    if quantized:
        kw["quantization_config"] = hf_quantization_config(BLOCK_FP8)
    return AutoConfig.for_model("qwen2", **kw)


def _metas(cfg):
    return served_metas(_hf_param_metas(cfg, torch.bfloat16), cfg)


def test_served_metas_mark_the_linear_weights_fp8_and_nothing_else():
    cfg = _config(**TINY_FP8)
    metas = _metas(cfg)
    fp8 = sorted(n for n, m in metas.items() if m.dtype == FP8_DTYPE)
    per_layer = [f"{p}.weight" for p in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj")] + [
        f"self_attn.{p}_proj.weight" for p in "koqv"
    ]
    assert fp8 == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in per_layer)
    assert metas["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert metas["lm_head.weight"].dtype == torch.bfloat16
    assert metas["model.layers.0.self_attn.q_proj.bias"].dtype == torch.bfloat16
    # a 16-bit checkpoint: unchanged
    plain = _hf_param_metas(_config(False, **TINY_FP8), torch.bfloat16)
    assert served_metas(plain, _config(False, **TINY_FP8)) is plain
    # layers the checkpoint leaves unquantized stay 16-bit, as SGLang's is_layer_skipped leaves them
    cfg.quantization_config = dict(cfg.quantization_config, ignored_layers=["model.layers.1.mlp.down_proj"])
    metas = _metas(cfg)
    assert metas["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert metas["model.layers.0.mlp.down_proj.weight"].dtype == FP8_DTYPE


def test_per_tensor_fp8_is_not_the_block_scheme():
    cfg = _config(**TINY_FP8)
    assert serves_block_fp8(cfg)
    cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert not serves_block_fp8(cfg)


@pytest.mark.parametrize(
    "shape,tp_ok,tp_bad",
    [(QWEN2_7B, (1, 2, 4), (8,)), (QWEN2_1_5B, (1, 2), (4,)), (TINY_FP8, (1,), (2,))],
    ids=["7b", "1.5b", "tiny"],
)
def test_block_alignment_of_qwen2_shapes_per_tp_size(shape, tp_ok, tp_bad):
    """7B: q 3584, k/v 512, gate/up 18944 rows, o/down 3584/18944 columns: multiples of 128 per rank up to tp 4
    (at 8, q's 448 rows a rank are not); 1.5B: up to tp 2 (at 4, gate/up's 2240 rows a rank are not); the tiny
    test model: k/v's 128 rows fit one block, not two ranks."""
    cfg = _config(**shape)
    metas = _metas(cfg)
    for tp in tp_ok:
        check_block_aligned(metas, cfg, tp)
    for tp in tp_bad:
        with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.\S+: .* per TP rank \(tp_size=\d\).* 16-bit"):
            check_block_aligned(metas, cfg, tp)


def test_a_fused_part_off_the_block_is_refused_before_sglang_starts():
    cfg = _config(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=1)  # k: 64 rows
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.self_attn\.k_proj\.weight: 64 rows give 64"):
        check_block_aligned(_metas(cfg), cfg, 1)
    plain = _config(False, hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=1)
    check_block_aligned(_metas(plain), plain, 1)  # 16-bit: no blocks


class _Fp8Sglang:
    """The engine surface the prepare reads, with SglangEngine's own decisions (no SGLang here)."""

    name = "sglang"
    loads_quantized = SglangEngine.loads_quantized

    def __init__(self, cfg):
        self._hf_config, self._metas = cfg, _metas(cfg)

    def param_metas(self):
        return dict(self._metas)


def _manifest(cfg, quantized: bool, sync_id="s1", bf16=()):
    metas = list(_hf_param_metas(_config(False, **{k: getattr(cfg, k) for k in TINY_FP8}), torch.bfloat16).values())
    if quantized:
        metas = export_metas(metas)
        metas = [TensorMeta(m.name, m.shape, torch.bfloat16) if m.name in bf16 else m for m in metas]
        metas = [m for m in metas if not (m.name.endswith("_scale_inv") and m.name[: -len("_scale_inv")] in bf16)]
    return make_manifest(
        metas,
        version=1,
        sync_id=sync_id,
        bucket_bytes=64 << 10,
        checksum_algo=ALGO,
        quantization=BLOCK_FP8 if quantized else None,
    )


def test_prepare_takes_the_pairs_and_refuses_what_sglang_does_not_hold():
    cfg = _config(**TINY_FP8)
    tx = SyncTransaction(_Fp8Sglang(cfg))
    assert tx.validate(_manifest(cfg, True)) is None  # the pairs go to SGLang as they are: no dequantizer
    with pytest.raises(SyncError) as refused:  # a 16-bit manifest
        tx.validate(_manifest(cfg, False, "s2"))
    msg = str(refused.value)
    assert msg.startswith("tensor model.layers.0.self_attn.q_proj.weight: the engine holds it in block FP8"), msg
    assert "holds it in block FP8" in msg and "(manifest.quantization: none)" in msg
    assert "set the trainer's export_dtype=fp8-block, or serve the model from a 16-bit checkpoint" in msg
    # one weight sent 16-bit inside a quantized manifest
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(SyncError, match=rf"tensor {name}: the engine holds it in block FP8 .* sends torch.bfloat16:"):
        tx.validate(_manifest(cfg, True, "s4", bf16=(name,)))
    # a weight SGLang keeps 16-bit (the checkpoint ignores that layer) sent in FP8
    cfg2 = _config(**TINY_FP8)
    cfg2.quantization_config = dict(cfg2.quantization_config, ignored_layers=["model.layers.0.self_attn.o_proj"])
    tx2 = SyncTransaction(_Fp8Sglang(cfg2))
    with pytest.raises(SyncError, match=r"o_proj\.weight: the manifest sends it in block FP8 but the engine holds"):
        tx2.validate(_manifest(cfg2, True, "s5"))


def test_rollout_svc_refuses_a_misaligned_fp8_checkpoint_before_starting_sglang(tmp_path):
    from types import SimpleNamespace

    cfg = _config(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=1)
    cfg.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # resolve_model wants weights; never read
    inference = SimpleNamespace(
        model=str(tmp_path), device="cuda:0", sglang={}, tp=1, receive_rank=0, dtype="bfloat16", init_seed=0
    )
    # SGLang is not installed here: getting as far as starting it would raise ModuleNotFoundError instead
    with pytest.raises(ValueError, match=r"k_proj\.weight: 64 rows give 64 per TP rank \(tp_size=1\)"):
        SglangEngine.from_rollout_config(inference)
