"""MegatronActor.save_hf finishes the export's collectives even when writing fails part-way:
the worker ranks are inside the same sequence of collectives, and an export left half-read would
hang the whole job on its next command."""

from types import SimpleNamespace

import pytest
import torch

from trainer_svc.actor.megatron.actor import MegatronActor
from weightsync.bus.plan import TensorMeta


def test_a_failed_hf_write_still_drains_the_export(tmp_path):
    names = ["a", "b", "c", "d"]
    read = []

    def export():
        for n in ["a", "c", "b", "d"]:  # out of order: write_hf_dir refuses at the second tensor
            read.append(n)
            yield n, torch.zeros(2)

    sent = []
    fake = SimpleNamespace(
        rmap=SimpleNamespace(rank=0),
        channel=SimpleNamespace(send=lambda op, **a: sent.append(op)),
        config=None,
        _metas=[TensorMeta(n, (2,), torch.float32) for n in names],
        _export=export,
    )
    fake._check_driver = lambda what: MegatronActor._check_driver(fake, what)
    with pytest.raises(ValueError, match="exported out of order"):
        MegatronActor.save_hf(fake, str(tmp_path / "out"))
    assert sent == ["export"] and read == ["a", "c", "b", "d"]
