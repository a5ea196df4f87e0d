"""Delta syncs over the NCCL transport's code path, on CPU: framed buckets, exact or failing.

A TrainerApp (hf, sync_encoding=delta, its NcclSender on a CPU stand-in bus) and RolloutApps (one
staged, one inplace) on loopback gRPC; the NCCL library is replaced by tests/support's in-process
loopback bus and by the gloo stand-in (tests/support/gloo_nccl.py: real broadcasts between ranks,
here in one process). Checked: once the rollouts hold the base, a 2 % change goes as delta frames
(a few percent of the bytes on the group) and both engines serve exactly the trainer's export; a
damaged base copy fails the commit by its checksum and the next sync goes dense; a target that
refuses the base makes every target dense (a broadcast reaches all alike); auto on a fast nccl link
sends dense, unframed, and keeps nothing (weightsync/publisher/delta_sync.py).
Real NCCL between two GPUs: tests/gpu/test_nccl_delta_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.fleet_sync import change_weights, sync_until_base_held
from tests.support.local_apps import local_fleet
from weightsync.bus.nccl import framed
from weightsync.bus.nccl.sender import NcclSender
from weightsync.v1 import rollout_pb2, trainer_pb2


def _bus(kind: str):
    if kind == "loopback":
        from tests.support.nccl_loopback import LoopbackBus

        return LoopbackBus(blocking_send=True)
    from tests.support.gloo_nccl import GlooNcclBus

    return GlooNcclBus()


@pytest.fixture(scope="module", params=["loopback", "gloo"])
def fleet(request):
    bus = _bus(request.param)
    with local_fleet(
        {"staged": {"apply_mode": "staged"}, "inplace": {"apply_mode": "inplace"}}, sync_encoding="delta"
    ) as fleet:
        fleet.trainer.orch.transports["nccl"] = NcclSender(torch.device("cpu"), bus, 10.0)
        fleet.trainer.orch.bucket_bytes = 64 << 10  # several buckets (tiny-qwen2 is 0.4 MB)
        for app in fleet.rollouts.values():
            app.servicer.nccl._bus = bus
        yield fleet


class _Frames:
    """Frames the trainer broadcast, by kind, since the last reset."""

    def __init__(self, monkeypatch):
        self.dense = self.delta = self.bytes = 0
        real = framed.FramedSender.send

        def send(sender, plan, buf, checksum, delta=None):
            if delta is None:
                self.dense += 1
            else:
                self.delta += 1
            self.bytes += plan.nbytes if delta is None else delta.numel()
            return real(sender, plan, buf, checksum, delta=delta)

        monkeypatch.setattr(framed.FramedSender, "send", send)


def _sync(stub, ids=()):
    return stub.Sync(trainer_pb2.SyncRequest(transport="nccl", rollout_ids=list(ids))).report


def _exact(trainer, app) -> bool:
    return (
        app.tx.version == trainer.actor.version
        and app.tx.state == rollout_pb2.SERVING
        and all(torch.equal(app.engine._target(name), t) for name, t in trainer.actor.export_tensors())
    )


def test_delta_frames_over_nccl_are_exact_and_small(fleet, monkeypatch):
    trainer, rollouts, stub = fleet
    sync_until_base_held(trainer, rollouts, lambda: _sync(stub), seed=1)
    frames = _Frames(monkeypatch)
    total = sum(b.nbytes for b in trainer.orch.delta._bufs.values())
    for seed in (2, 3, 4):
        frames.dense = frames.delta = frames.bytes = 0
        change_weights(trainer, 0.02, seed=seed)
        report = _sync(stub)
        assert report.ok, [r.error for r in report.rollouts]
        assert {r.encoding for r in report.rollouts} == {"delta"}, [r.encoding for r in report.rollouts]
        assert frames.delta > 0 and frames.dense == 0, (frames.delta, frames.dense)
        assert frames.bytes < 0.1 * total, (frames.bytes, total)  # 2 % of bf16 values: ~3 % of the bytes
        # what each rollout's report says went on the group for it: the frames, headers included
        assert all(r.wire_bytes == frames.bytes + 32 * frames.delta for r in report.rollouts), report.rollouts
        for app in rollouts.values():
            assert _exact(trainer, app), app.tx.version


def test_a_damaged_base_copy_fails_the_commit_and_the_next_sync_is_dense(fleet, monkeypatch):
    trainer, rollouts, stub = fleet
    sync_until_base_held(trainer, rollouts, lambda: _sync(stub), seed=10)
    a = rollouts["staged"]
    buf = next(iter(a.tx.delta_base._bufs.values()))
    buf[:4096] ^= 0x10  # spans words the delta changes: the result's checksum must catch it
    change_weights(trainer, 0.02, seed=11)
    report = _sync(stub)
    got = {r.rollout_id: r for r in report.rollouts}
    assert not got["staged"].ok
    assert a.tx.version != trainer.actor.version
    assert _exact(trainer, rollouts["inplace"])
    frames = _Frames(monkeypatch)
    change_weights(trainer, 0.02, seed=12)
    report = _sync(stub)
    assert report.ok, [r.error for r in report.rollouts]
    # the staged rollout lost its base: a broadcast reaches every member alike, so everyone gets it dense
    assert frames.delta == 0 and frames.dense > 0
    assert {r.encoding for r in report.rollouts} == {"full"}
    for app in rollouts.values():
        assert _exact(trainer, app)


def test_a_delta_frame_to_a_rollout_without_a_base_is_refused_not_applied():
    from weightsync.bus.delta.codec import encode
    from weightsync.bus.errors import TransportError
    from weightsync.bus.plan import TensorMeta, plan_buckets

    class _Group:
        """Rank 1 of a group whose broadcasts hand over what rank 0 sent."""

        rank, device = 1, torch.device("cpu")

        def __init__(self, frames):
            self.frames = list(frames)

        def broadcast(self, buf, timeout=None):
            buf.copy_(self.frames.pop(0))

    class _Root:
        rank, device = 0, torch.device("cpu")

        def __init__(self):
            self.sent = []

        def broadcast(self, buf, timeout=None):
            self.sent.append(buf.clone())

    (plan,) = plan_buckets([TensorMeta("w", (4096,), torch.bfloat16)], 1 << 20)
    base = torch.randint(0, 256, (plan.nbytes,), dtype=torch.uint8)
    new = base.clone()
    new[::97] ^= 1
    root = _Root()
    framed.FramedSender(root).send(plan, new, None, delta=encode(new, base, 2))
    rx = framed.FramedReceiver(_Group(root.sent), [plan], base=None)
    with pytest.raises(TransportError, match="keeps no delta base"):
        rx.recv(plan, 1.0)
    # a header that names another bucket or more bytes than the manifest allows is refused
    root = _Root()
    framed.FramedSender(root).send(plan, new, None)
    head = root.sent[0].clone()
    head[4] ^= 1  # the bucket index
    with pytest.raises(TransportError, match="frame says bucket"):
        framed.FramedReceiver(_Group([head, root.sent[1]]), [plan]).recv(plan, 1.0)
    got, _ = framed.FramedReceiver(_Group(root.sent), [plan]).recv(plan, 1.0)
    assert torch.equal(got, new)


def test_auto_on_nccl_streams_dense_and_unframed(fleet, monkeypatch):
    trainer, rollouts, stub = fleet
    frames = _Frames(monkeypatch)
    monkeypatch.setattr(trainer.orch.delta, "encoding", "auto")
    # every link fast (the earlier syncs measured this one): auto's choice over NVLink; a slow link's is
    # tests/unit/weightsync/bus/nccl/test_nccl_auto_link.py
    monkeypatch.setattr(trainer.orch.delta, "link_gbps", 1e-9)
    change_weights(trainer, 0.02, seed=20)
    report = _sync(stub)
    assert report.ok, [r.error for r in report.rollouts]
    assert frames.delta == frames.dense == 0  # no offer: the plain broadcasts
    assert {r.encoding for r in report.rollouts} == {"full"}
    assert not trainer.orch.delta.held  # nothing kept
    for app in rollouts.values():
        assert _exact(trainer, app)
