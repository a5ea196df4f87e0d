"""Issue 49: a checkpoint (or export) file is 0600 from its first byte, and a partial one left by a
trainer killed mid-save is removed at the next start (before, a 0644 rank_00000.pt.tmpNNNN stayed)."""

from __future__ import annotations

import os
import stat

import pytest

from trainer_svc.atomic_file import atomic_write
from trainer_svc.config import CheckpointConfig
from trainer_svc.train.checkpoint import resume_if_configured


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_the_temporary_file_is_0600_while_it_is_written(tmp_path, umask_022):
    seen = []

    def write(p):  # as torch.save and safetensors do: open for writing, then write
        with open(p, "wb") as f:
            f.write(b"x" * 10)
            seen.append(stat.S_IMODE(os.stat(p).st_mode))  # what a kill at this point would leave

    atomic_write(tmp_path / "rank_00000.pt", write)
    assert seen == [0o600]
    assert stat.S_IMODE(os.stat(tmp_path / "rank_00000.pt").st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["rank_00000.pt"]


def test_leftovers_of_a_killed_save_are_removed_at_the_next_start(tmp_path, caplog):
    step = tmp_path / "step_00000003"
    step.mkdir()
    (step / "rank_00000.pt").write_bytes(b"whole")
    left = [step / "rank_00000.pt.tmp4242", tmp_path / "latest.tmp17"]
    for p in left:
        p.write_bytes(b"partial")
    keep = [step / "notes.tmpfile", tmp_path / "latest"]
    for p in keep:
        p.write_text("step_00000003\n")
    assert not resume_if_configured(None, CheckpointConfig(checkpoint_dir=str(tmp_path), resume=False))
    assert not any(p.exists() for p in left)
    assert all(p.exists() for p in keep) and (step / "rank_00000.pt").read_bytes() == b"whole"
    assert "rank_00000.pt.tmp4242: a partial checkpoint file left by a trainer killed while saving" in caplog.text
