"""Delta syncs of an FP8 export (export_dtype=fp8-block) over TCP are bit-exact.

The delta is of the quantized buckets as they travel — e4m3 bytes, their float32 block scales and
the bf16 tensors — with one-byte words in a bucket that holds an FP8 tensor (weightsync/bus/delta/codec.py).
Real TrainerApp (hf, tiny-qwen2, sync_encoding=delta) and RolloutApps (staged, inplace) on loopback
gRPC, TCP bus. Checked after several 2 % changes synced as deltas: every rollout's copy of the
buckets is byte for byte the trainer's base (quantized bytes and scales), and its engine holds
exactly what a rollout synced in full at the same version holds (the same dequantized weights).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.fleet_sync import change_weights
from tests.support.local_apps import local_fleet
from weightsync.v1 import trainer_pb2


@pytest.fixture(scope="module")
def fleet():
    modes = {"staged": "staged", "inplace": "inplace", "fresh": "staged"}
    rollouts = {rid: {"apply_mode": mode} for rid, mode in modes.items()}
    with local_fleet(rollouts, export_dtype="fp8-block", sync_encoding="delta") as fleet:
        fleet.trainer.orch.bucket_bytes = 16 << 10  # several buckets
        yield fleet


def _sync(stub, ids):
    report = stub.Sync(trainer_pb2.SyncRequest(transport="tcp", rollout_ids=ids)).report
    assert report.ok, [r.error for r in report.rollouts]
    return report


def test_fp8_block_delta_syncs_are_bit_exact(fleet, monkeypatch):
    from weightsync.publisher import delta_sync

    trainer, rollouts, stub = fleet
    pair = ["staged", "inplace"]
    change_weights(trainer, 0.02, seed=0)
    _sync(stub, pair)  # both ends now hold the base
    words: list[int] = []  # the word size of every bucket encoded as a delta
    real_encode = delta_sync.encode

    def encode(new, base, word, d=None):
        words.append(word)
        return real_encode(new, base, word, d)

    monkeypatch.setattr(delta_sync, "encode", encode)
    for seed in (1, 2, 3):
        change_weights(trainer, 0.02, seed=seed)
        report = _sync(stub, pair)
        assert {r.encoding for r in report.rollouts} == {"delta"}, [r.encoding for r in report.rollouts]
        assert report.wire_bytes < report.bytes, (report.wire_bytes, report.bytes)
        held = trainer.orch.delta._bufs
        for rid in pair:
            copy = rollouts[rid].tx.delta_base._bufs
            assert sorted(copy) == sorted(held)
            for index, buf in held.items():  # the quantized bytes and scales, byte for byte
                assert torch.equal(copy[index], buf), (rid, index)
    assert 1 in words, words  # buckets holding e4m3 tensors went as one-byte words
    # a rollout synced in full at this version holds exactly the same (dequantized) weights
    report = _sync(stub, ["fresh"])
    assert [r.encoding for r in report.rollouts] == ["full"]
    ref = dict(rollouts["fresh"].engine.named_weights())
    assert ref
    for rid in pair:
        got = dict(rollouts[rid].engine.named_weights())
        assert rollouts[rid].tx.version == trainer.actor.version
        assert got.keys() == ref.keys()
        for name, t in ref.items():
            assert torch.equal(got[name], t), (rid, name)
