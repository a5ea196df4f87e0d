"""A trainer whose weights diverged (inf/nan) under export_dtype=fp8-block: the sync fails naming the
tensor, every rollout keeps its version, ExportHf writes nothing, and the next sync of finite weights
commits. Real TrainerApp (hf backend) and RolloutApps on loopback gRPC, TCP bus, small buckets so that
the bad tensor sits in the middle of the stream."""

from __future__ import annotations

import grpc
import pytest
import torch

from tests.support.local_apps import local_fleet
from weightsync.v1 import rollout_pb2, trainer_pb2

BAD = "model.layers.0.mlp.down_proj.weight"  # of 2 layers: buckets go out before and after it
ERROR = (
    f"tensor {BAD}: block [0, 0] holds inf or nan; refusing to export it as FP8 (the trainer's weights have diverged)"
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    rollouts = {"a": {"apply_mode": "staged"}, "b": {"apply_mode": "inplace"}}
    with local_fleet(rollouts, export_dtype="fp8-block", data_root=str(root)) as (trainer, apps, stub):
        trainer.orch.bucket_bytes = 16 << 10
        yield trainer, apps, stub, root


def _step(trainer, bad: bool) -> None:
    with torch.no_grad():
        for p in trainer.actor.model.parameters():
            p.add_(0.01)
        w = dict(trainer.actor.model.named_parameters())[BAD]
        w[10, 20] = float("nan") if bad else 0.5
    trainer.actor.version += 1


def _export_refused(stub, out_dir: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.ExportHf(trainer_pb2.ExportHfRequest(out_dir=out_dir))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"export_hf: {ERROR}"


def test_diverged_weights_fail_the_sync_and_the_export_and_the_rollouts_keep_their_version(fleet):
    trainer, rollouts, stub, root = fleet
    _step(trainer, bad=False)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="tcp")).report
    assert report.ok, [r.error for r in report.rollouts]
    good = trainer.actor.version
    assert report.num_buckets > 4
    served = {n: t.clone() for n, t in rollouts["a"].engine.named_weights()}
    stub.ExportHf(trainer_pb2.ExportHfRequest(out_dir="kept"))
    kept = {f.name: f.read_bytes() for f in (root / "kept").iterdir()}
    assert "model.safetensors" in kept and "config.json" in kept

    _step(trainer, bad=True)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="tcp")).report
    assert not report.ok
    assert sorted(r.rollout_id for r in report.rollouts if not r.ok) == ["a", "b"]
    for r in report.rollouts:
        assert r.error.endswith(f"stream: {ERROR}"), r.error
    for rid, app in rollouts.items():
        assert app.tx.version == good and app.tx.pending_sync_id == "", rid
    # staged: still serving the previous weights; inplace took buckets as they came, so it is stale
    # (it refuses to generate) until a complete sync commits
    assert rollouts["a"].tx.state == rollout_pb2.SERVING
    assert all(torch.equal(t, served[n]) for n, t in rollouts["a"].engine.named_weights())
    assert rollouts["b"].tx.state == rollout_pb2.STALE

    # ExportHf refuses with the same message, creates no directory and leaves an earlier export as it was
    _export_refused(stub, "fresh")
    assert not (root / "fresh").exists()
    _export_refused(stub, "kept")
    assert {f.name: f.read_bytes() for f in (root / "kept").iterdir()} == kept

    # finite weights again: the next sync commits everywhere
    _step(trainer, bad=False)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="tcp")).report
    assert report.ok, [r.error for r in report.rollouts]
    for app in rollouts.values():
        assert app.tx.version == trainer.actor.version and app.tx.state == rollout_pb2.SERVING
