"""Delta syncs over real NCCL between two GPUs, and the delta codec on CUDA tensors.

The CPU suite runs the same paths over stand-in buses (tests/unit/weightsync/bus/nccl/test_nccl_delta.py);
here libnccl carries the framed buckets, the trainer diffs on its GPU and the rollout keeps its
copy and applies the deltas on its own. In process: a TrainerApp (hf, tiny-qwen2, cuda:0,
sync_encoding=delta: both GPUs are on one host, where auto would pick full) and a RolloutApp on
cuda:1 per apply mode. Delta over IPC is refused by design (publisher/delta_sync.py), so not here.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.fleet_sync import change_weights
from weightsync.bus.nccl import framed

pytestmark = pytest.mark.gpu

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("density", [0.0001, 0.02, 0.3])
@pytest.mark.parametrize("n", [4 << 20, (4 << 20) + 6])  # and a tail past the last whole 32-bit word
def test_the_codec_runs_on_cuda_and_is_exact(density, n):
    from weightsync.bus.copy.checksum import bucket_checksum, from_sums, word_sums
    from weightsync.bus.delta.codec import apply_delta, diff, encode

    dev = torch.device("cuda:0")
    base = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    new = base.clone()
    w = new[: n - n % 2].view(torch.int16)
    pos = (torch.rand(w.numel(), device=dev) < density).nonzero().squeeze(1)
    w[pos] ^= 0x4321
    whole = n - n % 4
    d = diff(new, base, 2)
    payload = encode(new, base, 2, d)
    assert payload.is_cuda and payload.numel() < n
    out = base.clone()
    applied = apply_delta(payload, out, word_sums(base[:whole].view(torch.int32)))
    assert torch.equal(out, new)
    assert from_sums(applied.sums, new[whole:], n) == bucket_checksum(new)
    if n % 4 == 0:  # the trainer's incremental checksum (base sums + the diff's change) is the new bucket's
        got = from_sums(word_sums(base.view(torch.int32)) + d.sums_change(), new[whole:], n)
        assert got == bucket_checksum(new)
    d.write(base)
    assert torch.equal(base, new)


@pytest.fixture(scope="module", params=["staged", "inplace"])
def fleet(request):
    if NGPU < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {NGPU}")
    from tests.support.local_apps import local_fleet

    rollout = {"r": {"device": "cuda:1", "apply_mode": request.param}}
    with local_fleet(rollout, device="cuda:0", sync_timeout_s=60.0, sync_encoding="delta", transport="nccl") as (
        trainer,
        apps,
        stub,
    ):
        trainer.orch.bucket_bytes = 64 << 10  # several buckets (tiny-qwen2 is 0.4 MB)
        yield trainer, apps["r"], stub


def _sync(trainer, stub, seed):
    from weightsync.v1 import trainer_pb2

    change_weights(trainer, 0.02, seed)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="nccl")).report
    assert report.ok, [r.error for r in report.rollouts]
    return report


def _exact(trainer, app) -> bool:
    return app.tx.version == trainer.actor.version and all(
        torch.equal(app.engine._target(name).cpu(), t.cpu()) for name, t in trainer.actor.export_tensors()
    )


def test_delta_syncs_over_nccl_between_two_gpus_are_exact(fleet, monkeypatch):
    trainer, app, stub = fleet
    for seed in (1, 2):  # kept by the trainer; then offered, refused, framed dense and kept by the rollout
        _sync(trainer, stub, seed)
    assert app.tx.delta_base.held is not None
    assert all(b.is_cuda for b in app.tx.delta_base._bufs.values())  # the rollout's copy is on its GPU
    sent = {"delta": 0, "dense": 0, "bytes": 0}
    real = framed.FramedSender.send

    def send(sender, plan, buf, checksum, delta=None):
        sent["dense" if delta is None else "delta"] += 1
        sent["bytes"] += plan.nbytes if delta is None else delta.numel()
        return real(sender, plan, buf, checksum, delta=delta)

    monkeypatch.setattr(framed.FramedSender, "send", send)
    total = sum(b.nbytes for b in trainer.orch.delta._bufs.values())
    for seed in (3, 4, 5):
        sent.update(delta=0, dense=0, bytes=0)
        report = _sync(trainer, stub, seed)
        assert [r.encoding for r in report.rollouts] == ["delta"]
        assert sent["delta"] > 0 and sent["dense"] == 0, sent
        assert sent["bytes"] < 0.1 * total, (sent, total)
        assert _exact(trainer, app)
    # a damaged copy on the rollout's GPU fails the commit by its checksum; the next sync is dense and exact
    buf = next(iter(app.tx.delta_base._bufs.values()))
    buf[:4096] ^= 0x10
    change_weights(trainer, 0.02, 6)
    from weightsync.v1 import trainer_pb2

    report = stub.Sync(trainer_pb2.SyncRequest(transport="nccl")).report
    assert not report.ok and not report.rollouts[0].ok
    report = _sync(trainer, stub, 7)
    assert [r.encoding for r in report.rollouts] == ["full"]
    assert _exact(trainer, app)


@pytest.mark.parametrize("link_gbps, want", [(1e9, ["full", "full", "full", "delta"]), (1e-9, ["full"] * 4)])
def test_auto_decides_by_the_link_measured_over_real_nccl(fleet, monkeypatch, link_gbps, want):
    """sync_encoding=auto between two GPUs, the knob making any measured rate slow (10^9 Gb/s) or fast
    (1e-9): slow turns to deltas at the third sync after the one that measured, exact; fast stays full
    and keeps no base on the GPU (publisher/delta_sync.py)."""
    trainer, app, stub = fleet
    delta = trainer.orch.delta
    monkeypatch.setattr(delta, "encoding", "full")
    _sync(trainer, stub, 30)  # the group built (a fresh one measures nothing), every base dropped
    monkeypatch.setattr(delta, "encoding", "auto")
    monkeypatch.setattr(delta, "link_gbps", link_gbps)
    delta.link_rate = None
    got = []
    for seed in (31, 32, 33, 34):
        report = _sync(trainer, stub, seed)
        got.append(report.rollouts[0].encoding)
        assert delta.link_rate is not None and delta.link_rate > 0, seed  # on a reused group: measured
        assert _exact(trainer, app)
    assert got == want, got
    if link_gbps < 1:
        assert delta.held is None and delta.held_bytes() == 0
    else:
        assert report.wire_bytes < 0.15 * report.bytes, (report.wire_bytes, report.bytes)
        assert all(b.is_cuda for b in delta._bufs.values())
