"""weightsync.publisher.export_format: what `export_dtype` does to the actor's stream and to ExportHf's config."""

import pytest
import torch

from weightsync.bus.plan import TensorMeta
from weightsync.models import resolve_model
from weightsync.publisher.export_format import FP8_BLOCK, actor_dtype, export_format


def test_plain_dtypes_pass_the_stream_through():
    fmt = export_format("bfloat16")
    metas = [TensorMeta("model.layers.0.mlp.up_proj.weight", (128, 64), torch.bfloat16)]
    assert fmt.quantization is None and fmt.metas(metas) == metas and actor_dtype("bfloat16") == torch.bfloat16
    t = torch.ones(2, 2)
    assert list(fmt.tensors([("a", t)])) == [("a", t)]
    config = resolve_model("tiny-qwen2")[0]
    assert fmt.hf_config(config) is config


def test_fp8_block_quantizes_from_float32_and_declares_it_in_a_copy_of_the_config():
    fmt = export_format(FP8_BLOCK)
    assert actor_dtype(FP8_BLOCK) == torch.float32
    metas = fmt.metas(
        [
            TensorMeta("model.layers.0.mlp.up_proj.weight", (128, 64), torch.float32),
            TensorMeta("model.norm.weight", (64,), torch.float32),
        ]
    )
    assert [(m.name, m.dtype) for m in metas] == [
        ("model.layers.0.mlp.up_proj.weight_scale_inv", torch.float32),
        ("model.layers.0.mlp.up_proj.weight", torch.float8_e4m3fn),
        ("model.norm.weight", torch.bfloat16),
    ]
    config = resolve_model("tiny-qwen2")[0]
    out = fmt.hf_config(config)
    assert out.quantization_config["weight_block_size"] == [128, 128]
    assert getattr(config, "quantization_config", None) is None  # the actor's own config is untouched


def test_unknown_export_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="dtype 'fp4' is not one of"):
        actor_dtype("fp4")


def test_fp8_metas_and_owners_are_mapped_once_for_the_same_actor_metas():
    """A sync plans with the actor's same metas each time: the mapped list is the same object (the
    manifest cache then takes its identity fast path), and other metas or owners are mapped afresh."""
    fmt = export_format(FP8_BLOCK)
    plain = [
        TensorMeta("model.layers.0.mlp.up_proj.weight", (128, 64), torch.float32),
        TensorMeta("model.norm.weight", (64,), torch.float32),
    ]
    first = fmt.metas(plain)
    assert fmt.metas(list(plain)) is first  # a new list of the same metas, as actor.export_metas() gives
    assert fmt.owners(plain, [3, 5]) == [3, 3, 5]
    assert fmt.owners(list(plain), [3, 5]) == [3, 3, 5] and fmt.owners(plain, [1, 2]) == [1, 1, 2]
    other = [plain[1], TensorMeta("model.layers.0.mlp.down_proj.weight", (64, 128), torch.float32)]
    assert [m.name for m in fmt.metas(other)] == [
        "model.norm.weight",
        "model.layers.0.mlp.down_proj.weight_scale_inv",
        "model.layers.0.mlp.down_proj.weight",
    ]
    assert fmt.owners(other, [4, 6]) == [4, 6, 6]
    assert export_format(FP8_BLOCK) == fmt  # the memo is no part of the format's identity
