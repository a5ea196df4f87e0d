"""Delta syncs from several NCCL senders, on CPU: every trainer rank frames its own group's buckets.

Rank 0's path is real (TrainerApp with sync_encoding=delta, SyncAttempt, a group planned per
sender); two threads play the two trainer ranks through multisender.run_sender (the per-rank
stand-in of test_nccl_multisender_liveness.py), each diffing and keeping its own buckets as its part
of the base; two RolloutApps (staged, inplace) receive each sender's group with a framed receiver
over their delta base. NCCL is the gloo stand-in (tests/support/gloo_nccl.py: real broadcasts, here
between threads of one process). Checked: once the rollouts hold the base, a 2 % change goes as
delta frames from every sending rank (a few percent of the bytes, per rollout in the SyncReport)
and both engines serve exactly the trainer's export; a rank that lost its part frames its buckets
dense while the other sends deltas; a rollout on another base makes every rank's frames dense (a
broadcast reaches all alike), still exact; a damaged base copy fails that rollout's commit by its
checksum. The same through torchrun ranks and rollout processes: tests/e2e/test_nccl_multisender_e2e.py.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.support.fleet_sync import assert_serves_export, change_weights, sync_until_base_held
from tests.support.gloo_nccl import GlooNcclBus
from tests.support.local_apps import local_fleet
from tests.unit.weightsync.bus.nccl.test_nccl_multisender_liveness import TwoRankActor
from weightsync.bus.nccl import framed
from weightsync.bus.nccl.framed import HEADER_BYTES
from weightsync.bus.nccl.sender import NcclSender
from weightsync.v1 import trainer_pb2


@pytest.fixture(scope="module")
def fleet():
    bus = GlooNcclBus()
    with local_fleet(
        {"staged": {"apply_mode": "staged"}, "inplace": {"apply_mode": "inplace"}},
        sync_encoding="delta",
        sync_timeout_s=20.0,
    ) as fleet:
        trainer = fleet.trainer
        trainer.orch.actor = TwoRankActor(trainer.actor, bus, watched=True)
        trainer.orch.transports["nccl"] = NcclSender(
            torch.device("cpu"), bus, 10.0, call=trainer.orch.rollouts.call, watch_period=0.2
        )
        trainer.orch.bucket_bytes = 64 << 10  # several buckets per rank (tiny-qwen2 is 0.4 MB)
        for app in fleet.rollouts.values():
            app.servicer.nccl._bus = bus
        yield fleet


class _Frames:
    """The frames each trainer rank broadcast on its group, by kind, and their payload bytes."""

    def __init__(self, monkeypatch, actor):
        self.actor = actor
        self.sent: list = []  # (group, kind, payload bytes)
        real = framed.FramedSender.send

        def send(sender, plan, buf, checksum, delta=None):
            n = plan.nbytes if delta is None else delta.numel()
            self.sent.append((sender.group, "dense" if delta is None else "delta", n))
            return real(sender, plan, buf, checksum, delta=delta)

        monkeypatch.setattr(framed.FramedSender, "send", send)

    def by_rank(self) -> dict[int, dict[str, int]]:
        """sender rank -> {kind: frames} of the last sync (each rank's group, as it holds it now)."""
        groups = {id(r.rank_sync_state().nccl_groups._group): r.rank for r in self.actor.ranks}
        out: dict = defaultdict(lambda: defaultdict(int))
        for group, kind, _ in self.sent:
            out[groups[id(group)]][kind] += 1
        return {rank: dict(kinds) for rank, kinds in out.items()}

    @property
    def wire(self) -> int:
        return sum(n + HEADER_BYTES for _, _, n in self.sent)


def _sync(stub, ids=("staged", "inplace")) -> trainer_pb2.SyncReport:
    report = stub.Sync(trainer_pb2.SyncRequest(transport="nccl", senders="all", rollout_ids=list(ids))).report
    assert sorted(s.rank for s in report.senders) == [0, 1], report.senders  # both ranks streamed
    return report


def _buckets(report) -> dict[int, int]:
    return {s.rank: s.num_buckets for s in report.senders}


def test_every_sending_rank_frames_its_own_buckets_as_deltas_and_the_rollouts_end_exact(fleet, monkeypatch):
    trainer, rollouts, stub = fleet
    sync_until_base_held(trainer, rollouts, lambda: _sync(stub), seed=1)
    frames = _Frames(monkeypatch, trainer.orch.actor)
    change_weights(trainer, 0.02, seed=2)
    report = _sync(stub)
    assert report.ok, [r.error for r in report.rollouts]
    n = _buckets(report)
    assert all(n[r] > 1 for r in (0, 1)), n
    # every rank sent every one of its buckets as a delta frame on its own group
    assert frames.by_rank() == {0: {"delta": n[0]}, 1: {"delta": n[1]}}, frames.by_rank()
    total = sum(s.bytes for s in report.senders)
    for r in report.rollouts:
        assert r.encoding == "delta", report.rollouts
        # what went on both groups for it, headers included: 2 % of bf16 values, a few % of the bytes
        assert r.wire_bytes == frames.wire and r.wire_bytes < 0.1 * total, (r.wire_bytes, total)
    for app in rollouts.values():
        assert_serves_export(trainer, app)

    # rank 1 lost its part (restarted): its buckets go as dense frames, rank 0's as deltas, still exact
    trainer.orch.actor.ranks[1].rank_sync_state().delta_part.drop()
    frames.sent.clear()
    change_weights(trainer, 0.02, seed=3)
    report = _sync(stub)
    assert report.ok, [r.error for r in report.rollouts]
    n = _buckets(report)
    assert frames.by_rank() == {0: {"delta": n[0]}, 1: {"dense": n[1]}}, frames.by_rank()
    assert {r.encoding for r in report.rollouts} == {"delta"}
    assert all(r.wire_bytes == frames.wire for r in report.rollouts), report.rollouts
    for app in rollouts.values():
        assert_serves_export(trainer, app)
    # and it holds its part again: deltas from both ranks
    frames.sent.clear()
    change_weights(trainer, 0.02, seed=4)
    report = _sync(stub)
    assert report.ok and {r.encoding for r in report.rollouts} == {"delta"}, report.rollouts
    assert frames.by_rank() == {0: {"delta": n[0]}, 1: {"delta": n[1]}}, frames.by_rank()
    for app in rollouts.values():
        assert_serves_export(trainer, app)


def test_a_rollout_on_another_base_gets_dense_frames_from_every_rank_and_ends_exact(fleet, monkeypatch):
    trainer, rollouts, stub = fleet
    sync_until_base_held(trainer, rollouts, lambda: _sync(stub), seed=10)
    # the staged rollout moves on alone: the inplace one stays on the earlier base
    change_weights(trainer, 0.02, seed=11)
    assert _sync(stub, ["staged"]).ok
    frames = _Frames(monkeypatch, trainer.orch.actor)
    change_weights(trainer, 0.02, seed=12)
    report = _sync(stub)
    assert report.ok, [r.error for r in report.rollouts]
    n = _buckets(report)
    # the inplace rollout refused the base; a broadcast reaches every member alike: all dense, on every group
    assert frames.by_rank() == {0: {"dense": n[0]}, 1: {"dense": n[1]}}, frames.by_rank()
    assert {r.encoding for r in report.rollouts} == {"full"}
    assert all(r.wire_bytes == frames.wire for r in report.rollouts), report.rollouts
    for app in rollouts.values():
        assert_serves_export(trainer, app)

    # a damaged base copy: the delta applies onto the wrong bytes, and that rollout's commit fails by its checksum
    buf = next(iter(rollouts["staged"].tx.delta_base._bufs.values()))
    buf[:4096] ^= 0x10
    before = rollouts["staged"].tx.version
    frames.sent.clear()
    change_weights(trainer, 0.02, seed=13)
    report = _sync(stub)
    got = {r.rollout_id: r for r in report.rollouts}
    assert frames.by_rank() == {0: {"delta": n[0]}, 1: {"delta": n[1]}}, frames.by_rank()
    assert not got["staged"].ok and rollouts["staged"].tx.version == before, got["staged"]
    assert got["inplace"].ok
    assert_serves_export(trainer, rollouts["inplace"])
    # it lost its base: the next sync reaches it (and everyone) dense, and it ends exact
    frames.sent.clear()
    change_weights(trainer, 0.02, seed=14)
    report = _sync(stub)
    assert report.ok and {r.encoding for r in report.rollouts} == {"full"}, report.rollouts
    assert frames.by_rank() == {0: {"dense": n[0]}, 1: {"dense": n[1]}}, frames.by_rank()
    for app in rollouts.values():
        assert_serves_export(trainer, app)
