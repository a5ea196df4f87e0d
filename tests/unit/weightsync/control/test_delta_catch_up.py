"""Catch-up syncs at one version, then a fleet sync as deltas: what issue 35's demo run failed once.

The RL demo's trainer caught its two rollouts up one at a time (a sync to rollout-1, then one to
rollout-0, both at the trainer's version) and then synced both: the delta to rollout-1 failed its
checksum (DATA_LOSS). Each catch-up streamed the same tensors, but a packed bucket's alignment gaps
(weightsync/bus/plan.py: every tensor starts at a 256-byte boundary) were whatever the freshly
allocated pack buffer held, so the two streams differed there; the trainer's base followed the
second stream while rollout-1 held the first. Here every pack buffer is allocated dirty, and
dirty differently each time (as uninitialized memory may be), so the sequence fails every time
unless the streams of one export are byte-identical.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.fleet_sync import bump_and_sync_exactly
from tests.support.local_apps import local_fleet
from weightsync.bus import pipeline
from weightsync.v1 import trainer_pb2


@pytest.fixture(scope="module")
def fleet():
    with local_fleet({"rollout-0": {}, "rollout-1": {}}, sync_encoding="delta") as fleet:
        yield fleet


@pytest.fixture
def dirty_pack_buffers(monkeypatch):
    """Every pack buffer the pipeline allocates starts with the bytes the previous one held, about
    half of them changed (as memory the allocator hands out again may be, partly overwritten)."""
    g = torch.Generator().manual_seed(0)
    memory = torch.zeros(0, dtype=torch.uint8)

    def alloc(nbytes, device="cpu", pin=False):
        nonlocal memory
        if memory.numel() < nbytes:
            memory = torch.cat([memory, torch.zeros(nbytes - memory.numel(), dtype=torch.uint8)])
        changed = torch.rand(memory.numel(), generator=g) < 0.5
        memory[changed] = torch.randint(0, 256, (int(changed.sum()),), generator=g, dtype=torch.uint8)
        return memory[:nbytes].clone().to(device)

    monkeypatch.setattr(pipeline, "alloc_buffer", alloc)


def _sync(stub, *rollout_ids: str) -> trainer_pb2.SyncReport:
    return stub.Sync(trainer_pb2.SyncRequest(transport="tcp", rollout_ids=list(rollout_ids))).report


def test_catch_up_syncs_one_at_a_time_then_a_fleet_delta_is_exact(fleet, dirty_pack_buffers):
    trainer, rollouts, stub = fleet
    for _ in range(3):  # as the demo: each rollout caught up alone, at the trainer's (new) version
        with torch.no_grad():
            for p in trainer.actor.model.parameters():
                p.add_(0.01)
        trainer.actor.version += 1
        for rid in ("rollout-1", "rollout-0"):
            report = _sync(stub, rid)
            assert report.ok, [r.error for r in report.rollouts]
        # then the loop's first sync to everyone, at that same version: both hold what the trainer holds
        report = _sync(stub)
        assert report.ok, [r.error for r in report.rollouts]
        assert {r.rollout_id: r.encoding for r in report.rollouts} == {"rollout-0": "delta", "rollout-1": "delta"}
        assert all(r.wire_bytes < 1024 for r in report.rollouts)  # the same bytes again: headers only
    bump_and_sync_exactly(trainer, rollouts, stub)  # and the next version's delta is exact everywhere


def test_a_version_streamed_again_with_other_bytes_is_sent_in_full_to_who_holds_the_first(fleet):
    """An exporter that is not deterministic at one version (here: a weight changed without a new
    version) makes the second catch-up differ from the first: rollout-1, which holds the first,
    must get the fleet sync in full, not a delta from the trainer's base (the second)."""
    trainer, rollouts, stub = fleet
    trainer.actor.version += 1
    assert _sync(stub, "rollout-1").ok
    with torch.no_grad():
        next(trainer.actor.model.parameters()).view(-1)[:3] += 1.0  # same version, other bytes
    assert _sync(stub, "rollout-0").ok
    report = _sync(stub)
    assert report.ok, [r.error for r in report.rollouts]
    assert {r.rollout_id: r.encoding for r in report.rollouts} == {"rollout-0": "delta", "rollout-1": "full"}
    assert rollouts["rollout-0"].tx.delta_base.held_sync == rollouts["rollout-1"].tx.delta_base.held_sync
    report = bump_and_sync_exactly(trainer, rollouts, stub)  # both on the base again: deltas, exact
    assert all(r.encoding == "delta" for r in report.rollouts)
