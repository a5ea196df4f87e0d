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
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)
    # main() relaunches itself under torchrun when tp*pp > 1
    return subprocess.run([sys.executable, "-m", "trainer_svc.actor.megatron.convert", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)


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
