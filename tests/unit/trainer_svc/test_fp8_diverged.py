"""A trainer whose weights diverged (inf/nan) under export_dtype=fp8-block: the sync fails naming the
tensor, every rollout keeps its version, ExportHf writes nothing, and the next sync of finite weights
commits. Real TrainerApp (hf backend) and RolloutApps on loopback gRPC, TCP bus, small buckets so that
the bad tensor sits in the middle of the stream."""

from __future__ import annotations

import grpc
import pytest
import torch

from weightsync.control.client import channel, trainer_stub
from weightsync.v1 import rollout_pb2, trainer_pb2

BAD = "model.layers.0.mlp.down_proj.weight"  # of 2 layers: buckets go out before and after it
ERROR = (
    f"tensor {BAD}: block [0, 0] holds inf or nan; refusing to export it as FP8 (the trainer's weights have diverged)"
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from rollout_svc.app import RolloutApp
    from rollout_svc.config import RolloutConfig
    from trainer_svc.app import TrainerApp
    from trainer_svc.config import TrainerConfig

    root = tmp_path_factory.mktemp("data")
    trainer = TrainerApp(
        TrainerConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            backend="hf",
            model="tiny-qwen2",
            export_dtype="fp8-block",
            sync_timeout_s=30.0,
            auto_sync_new_rollouts=False,
            data_root=str(root),
        )
    )
    trainer.orch.bucket_bytes = 16 << 10
    trainer.start()
    rollouts = {}
    for rid, mode in (("a", "staged"), ("b", "inplace")):
        app = RolloutApp(
            RolloutConfig.from_flat(
                grpc_address="127.0.0.1:0",
                http_address="127.0.0.1:0",
                model="tiny-qwen2",
                rollout_id=rid,
                apply_mode=mode,
            )
        )
        app.start()
        rollouts[rid] = app
    stub = trainer_stub(channel(trainer.grpc.address), "", 60)
    for rid, app in rollouts.items():
        stub.RegisterRollout(trainer_pb2.RegisterRolloutRequest(rollout_id=rid, address=app.grpc.address))
    yield trainer, rollouts, stub, root
    for app in rollouts.values():
        app.stop()
    trainer.stop()


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
