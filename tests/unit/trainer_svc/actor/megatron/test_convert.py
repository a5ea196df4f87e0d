"""The converter: HF -> Megatron checkpoint (TP=2, PP=2 with VPP) -> HF, bit-exact, via its CLI logic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[5]


def _convert(*argv: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    env.pop("WORLD_SIZE", None)
    # main() relaunches itself under torchrun when tp*pp > 1
    return subprocess.run(
        [sys.executable, "-m", "trainer_svc.actor.megatron.convert", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_hf_to_megatron_to_hf_is_exact(hf_dirs, tmp_path):
    from safetensors.torch import load_file

    src = hf_dirs["qwen3"]
    ck, back = tmp_path / "ck", tmp_path / "hf"
    p = _convert("to-megatron", "--hf", str(src), "--out", str(ck), "--tp", "1", "--pp", "2", "--vpp", "2")
    assert p.returncode == 0, p.stderr[-5000:]
    assert sorted(f.name for f in ck.glob("mp_rank_*.pt")) == ["mp_rank_00_000.pt", "mp_rank_00_001.pt"]
    p = _convert("to-hf", "--ckpt", str(ck), "--out", str(back))
    assert p.returncode == 0, p.stderr[-5000:]
    want, got = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    assert (back / "config.json").is_file()


def test_not_a_checkpoint_is_refused(tmp_path):
    from trainer_svc.actor.megatron.convert import main

    with pytest.raises(ValueError, match="megatron_checkpoint.json"):
        main(["to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "x")])


def test_te_named_checkpoint_at_pp2_back_to_hf_is_exact(tmp_path):
    """--names te writes TE-spec state dicts (fused norms by *global* layer kind: at PP=2 stage 1's
    local layer 1 is global MoE layer 3, whose pre-MLP norm TE keeps separate); to-hf loads them into
    the local-spec model exactly."""
    from safetensors.torch import load_file

    from tests.support.megatron_models import make_config, save_random_hf

    src = save_random_hf(make_config("qwen3_moe"), tmp_path / "src", seed=2)
    ck, back = tmp_path / "ck", tmp_path / "hf"
    p = _convert("to-megatron", "--hf", str(src), "--out", str(ck), "--pp", "2", "--names", "te")
    assert p.returncode == 0, p.stderr[-5000:]
    stage0 = torch.load(ck / "mp_rank_00_000.pt", weights_only=True)["chunks"][0]
    stage1 = torch.load(ck / "mp_rank_00_001.pt", weights_only=True)["chunks"][0]
    # global layer 1 is dense (mlp_only_layers=[1]): both norms fused; layers 0, 2, 3 are MoE
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in stage0
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in stage0
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in stage1
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in stage1
    assert not any(k.endswith(("input_layernorm.weight", "_extra_state")) for k in [*stage0, *stage1])
    p = _convert("to-hf", "--ckpt", str(ck), "--out", str(back))
    assert p.returncode == 0, p.stderr[-5000:]
    want, got = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
