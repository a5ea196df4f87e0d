"""Exports and checkpoints replace each file whole: a write that dies part-way leaves the previous
file intact and no partial file behind (a rollout's LoadWeights may be reading the directory)."""

import pytest
import torch
from safetensors.torch import load_file

import trainer_svc.atomic_file as atomic_file
from trainer_svc.actor.hf.actor import HfActor
from trainer_svc.export_hf import save_hf_dir


def _actor():
    from weightsync.models import resolve_model

    return HfActor(resolve_model("tiny-qwen2")[0], seed=3)


def test_an_export_that_dies_mid_write_leaves_the_previous_export_whole(tmp_path, monkeypatch):
    actor = _actor()
    assert save_hf_dir(actor, str(tmp_path)) > 0
    before = load_file(str(tmp_path / "model.safetensors"))
    config = (tmp_path / "config.json").read_text()
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(1.0)

    def dies(tensors, path, metadata=None):  # half a file, then the process "dies"
        with open(path, "wb") as f:
            f.write(b"\x00" * 100)
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", dies)
    monkeypatch.setattr("trainer_svc.export_hf.save_file", dies, raising=False)  # wherever it is looked up
    with pytest.raises(OSError, match="disk full"):
        save_hf_dir(actor, str(tmp_path))
    after = load_file(str(tmp_path / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert (tmp_path / "config.json").read_text() == config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_atomic_write_replaces_the_file_and_config_matches_save_pretrained(tmp_path):
    target = tmp_path / "latest"
    target.write_text("old\n")
    atomic_file.atomic_write(target, lambda p: p.write_text("new\n"))
    assert target.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["latest"]
    cfg = _actor().hf_config()
    cfg.save_pretrained(str(tmp_path / "ref"))
    atomic_file.save_config(cfg, tmp_path)
    assert (tmp_path / "config.json").read_text() == (tmp_path / "ref" / "config.json").read_text()
