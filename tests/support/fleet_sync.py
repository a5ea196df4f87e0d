"""A sync through real services in-process, checked bit-exact: shared by the control-plane tests."""

from __future__ import annotations

import torch

from weightsync.v1 import rollout_pb2, trainer_pb2


def change_weights(trainer, fraction: float = 0.02, seed: int = 0) -> None:
    """Change `fraction` of the trainer's values, the same ones for the same seed (a new version): what a
    delta sync sends in part."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.actor.model.parameters():
            mask = (torch.rand(p.shape, generator=g) < fraction).to(p.device)
            p[mask] = p[mask] * 1.5 + 0.01
    trainer.actor.version += 1


def sync_until_base_held(trainer, rollouts: dict, sync, seed: int) -> None:
    """Change 2 % of the weights and `sync()` until the trainer and every rollout hold a delta base (the
    first sync keeps the trainer's copy unoffered; the next offers it, is refused, goes dense and is
    kept by the rollouts); every sync must commit."""
    for i in range(3):
        if all(app.tx.delta_base.held is not None for app in rollouts.values()) and trainer.orch.delta.held:
            return
        change_weights(trainer, 0.02, seed=seed + 100 + i)
        report = sync()
        assert report.ok, [r.error for r in report.rollouts]
    raise AssertionError("the rollouts never held the base")


def bump_weights(trainer) -> None:
    """Change every trainer weight (a new version): what a full sync sends."""
    with torch.no_grad():
        for p in trainer.actor.model.parameters():
            p.add_(0.01)
    trainer.actor.version += 1


def assert_serves_export(trainer, app) -> None:
    """`app` holds exactly the trainer's export (same dtype, bit for bit) and serves its version."""
    exported = list(trainer.actor.export_tensors())
    assert exported
    for name, t in exported:
        assert torch.equal(app.engine._target(name), t), name
    assert app.tx.version == trainer.actor.version and app.tx.state == rollout_pb2.SERVING


def bump_and_sync_exactly(trainer, rollouts: dict, stub, transport: str = "tcp"):
    """Change every trainer weight, Sync, and check every rollout serves exactly the export at the
    new version; returns the SyncReport."""
    bump_weights(trainer)
    report = stub.Sync(trainer_pb2.SyncRequest(transport=transport)).report
    assert report.ok, [r.error for r in report.rollouts]
    exported = list(trainer.actor.export_tensors())
    for app in rollouts.values():
        assert app.tx.version == trainer.actor.version and app.tx.state == rollout_pb2.SERVING
        for name, t in exported:
            assert torch.equal(app.engine._target(name), t.to(app.engine._target(name).dtype)), name
    return report


def rollout_calls(trainer) -> dict[tuple[str, str], float]:
    """(method, path) -> how many calls the trainer made to its rollouts so far, from its metrics
    (path: "grpc" or "link", the sync link)."""
    out = {}
    for metric in trainer.orch.metrics.calls.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[(s.labels["method"], s.labels["path"])] = s.value
    return out
