"""The torch_dist acceptance case shared by the CPU test (gloo) and the GPU test (NCCL): one 2-rank
launch of `_dist_torch_dist.py` and the checks on its report."""

from __future__ import annotations

import json

from tests.support.megatron_models import SUPPORT, make_config, save_random_hf, torchrun

FAMILIES = ("qwen2", "llama", "qwen3", "qwen3_moe")


def check_torch_dist_across_layouts(tmp_path) -> None:
    dirs = [save_random_hf(make_config(f), tmp_path / "hf" / f, seed=i) for i, f in enumerate(FAMILIES)]
    out, work = tmp_path / "report.json", tmp_path / "ckpt"
    work.mkdir()
    proc = torchrun(
        SUPPORT / "_dist_torch_dist.py", 2, ["--out", str(out), "--work", str(work), *map(str, dirs)], timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rep = json.loads(out.read_text())
    for family in FAMILIES:
        res = rep[family]
        assert res["tracker"] == "7"
        for names in ("megatron", "te", "local"):
            assert res[f"params_exact_{names}"], f"{family}/{names}: parameters differ from the HF load at TP=1 PP=2"
            assert res[f"export_exact_{names}"], f"{family}/{names}: export differs from the HF tensors"
            assert res[f"version_{names}"] == 1
    # the spellings really differ where the specs do. Dense layers: megatron-core's local spec already
    # writes the TE spelling of the fused norms; the module names are the local spec's own
    keys = rep["qwen2"]["keys"]
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys["megatron"]
    assert keys["te"] == keys["megatron"]
    assert "decoder.layers.input_layernorm.weight" in keys["local"]
    assert "decoder.layers.pre_mlp_layernorm.weight" in keys["local"]
    assert not any("layer_norm_weight" in k for k in keys["local"])
    # MoE layer 0: the TE spec keeps a separate pre-MLP norm, megatron-core's local spec maps it to
    # the fused name; the dense layer 1 is fused under both
    moe = rep["qwen3_moe"]["keys"]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in moe["megatron"]
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in moe["te"]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" not in moe["te"]
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in moe["te"]
    # SequentialMLP and TEGroupedMLP write the same stacked expert keys
    assert "decoder.layers.0.mlp.experts.experts.linear_fc1.weight" in moe["te"]
    err = rep["wrong_model_error"]
    assert err and "q_layernorm.weight" in err and "(on rank" in err, err
    err = rep["not_a_checkpoint_error"]
    assert err and "latest_checkpointed_iteration.txt" in err, err
