"""Delta syncs through real services: only the changed words travel, and the result is bit-exact or the sync fails.

Real TrainerApp (hf backend, sync_encoding=delta) and RolloutApps (one staged, one inplace) on
loopback gRPC, TCP bus. Checked: the first sync goes in full (no base yet), a sync after 2 % of the
values changed goes as deltas of at most 0.15x the model's bytes and is bit-exact; a rollout whose
base differs is sent in full (and ends exact); a rollout whose copy of the base was damaged, or a
damaged delta, fails the commit by its checksum, keeps its version, and the next sync is full and
exact. The wire bytes are in the report and the metric.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.fleet_sync import bump_and_sync_exactly, change_weights
from tests.support.local_apps import local_fleet
from weightsync.v1 import rollout_pb2, trainer_pb2


@pytest.fixture(scope="module")
def fleet():
    with local_fleet({"a": {"apply_mode": "staged"}, "b": {"apply_mode": "inplace"}}, sync_encoding="delta") as fleet:
        bump_and_sync_exactly(*fleet)  # every test starts from a committed base
        yield fleet


def _sync(stub) -> trainer_pb2.SyncReport:
    return stub.Sync(trainer_pb2.SyncRequest(transport="tcp")).report


def _exact(trainer, app) -> bool:
    return app.tx.version == trainer.actor.version and all(
        torch.equal(app.engine._target(name), t.to(app.engine._target(name).dtype))
        for name, t in trainer.actor.export_tensors()
    )


def _by_id(report) -> dict:
    return {r.rollout_id: r for r in report.rollouts}


def _wire_metric(trainer, encoding: str) -> float:
    v = trainer.metrics.registry.get_sample_value(
        "weightsync_sync_wire_bytes_total", {"role": "trainer", "encoding": encoding}
    )
    return v or 0.0


def test_small_change_goes_as_a_small_exact_delta(fleet):
    trainer, rollouts, stub = fleet
    before = _wire_metric(trainer, "delta")
    change_weights(trainer, 0.02)
    report = _sync(stub)
    assert report.ok, [r.error for r in report.rollouts]
    for rid, r in _by_id(report).items():
        assert r.encoding == "delta", rid
        assert 0 < r.wire_bytes <= 0.15 * report.bytes, (rid, r.wire_bytes, report.bytes)
        assert _exact(trainer, rollouts[rid]), rid
    assert report.wire_bytes == sum(r.wire_bytes for r in report.rollouts)
    assert _wire_metric(trainer, "delta") - before == report.wire_bytes
    # nothing changed at all: still a delta (of headers only), still exact
    trainer.actor.version += 1
    report = _sync(stub)
    assert report.ok and all(r.encoding == "delta" and r.wire_bytes < 1024 for r in report.rollouts)
    assert all(_exact(trainer, app) for app in rollouts.values())


def test_a_rollout_on_another_base_is_sent_in_full_and_ends_exact(fleet):
    trainer, rollouts, stub = fleet
    base = rollouts["a"].tx.delta_base
    origin, version, digest = base.held
    base.held = (origin, version - 1, digest)  # as if it held an older version's buckets
    change_weights(trainer, 0.02, seed=1)
    report = _sync(stub)
    assert report.ok, [r.error for r in report.rollouts]
    got = _by_id(report)
    assert got["a"].encoding == "full" and got["a"].wire_bytes >= report.bytes
    assert got["b"].encoding == "delta" and got["b"].wire_bytes <= 0.15 * report.bytes
    assert _exact(trainer, rollouts["a"]) and _exact(trainer, rollouts["b"])
    # and from there on "a" is on the base again
    change_weights(trainer, 0.02, seed=2)
    report = _sync(stub)
    assert report.ok and {r.encoding for r in report.rollouts} == {"delta"}


def test_a_damaged_base_copy_fails_the_commit_and_the_next_sync_is_full(fleet):
    trainer, rollouts, stub = fleet
    a = rollouts["a"]
    held_version = a.tx.version
    buf = next(iter(a.tx.delta_base._bufs.values()))
    # its copy no longer matches the version it serves: the result's checksum must catch it. The check
    # is of the copy's kept word sums and the words the delta changes (no pass over the bucket), so the
    # damage spans enough words that the delta changes some (2 % of 2048 values: all but certain);
    # damage no delta touches never reaches the engine (test_delta_sparse_apply.py)
    buf[:4096] ^= 0x10
    change_weights(trainer, 0.02, seed=3)
    report = _sync(stub)
    got = _by_id(report)
    # the rollout refused the result by its checksum (at receipt, or at commit if that came first)
    assert not got["a"].ok and got["a"].encoding == "delta" and "checksum" in a.tx.last_error
    assert got["b"].ok and _exact(trainer, rollouts["b"])
    assert a.tx.version == held_version and a.tx.state == rollout_pb2.SERVING  # staged: the old version serves
    change_weights(trainer, 0.02, seed=4)
    report = _sync(stub)
    got = _by_id(report)
    assert report.ok and got["a"].encoding == "full" and got["b"].encoding == "delta"
    assert _exact(trainer, a) and _exact(trainer, rollouts["b"])


def test_a_damaged_delta_fails_the_commit_and_the_next_sync_is_full(fleet, monkeypatch):
    trainer, rollouts, stub = fleet
    from weightsync.publisher import delta_sync

    real = delta_sync.encode

    def flipped(*args):
        payload = real(*args)
        if payload is not None:
            payload[-1] ^= 0x01  # the last new word: decodes fine, applies a wrong value
        return payload

    monkeypatch.setattr(delta_sync, "encode", flipped)
    versions = {rid: app.tx.version for rid, app in rollouts.items()}
    change_weights(trainer, 0.02, seed=5)
    report = _sync(stub)
    assert not report.ok
    for rid, r in _by_id(report).items():
        assert not r.ok and r.encoding == "delta" and "checksum" in rollouts[rid].tx.last_error, (rid, r.error)
        assert rollouts[rid].tx.version == versions[rid]
        # one bucket, checked before it is written: inplace keeps serving the old version too
        assert rollouts[rid].tx.state == rollout_pb2.SERVING
    monkeypatch.setattr(delta_sync, "encode", real)
    change_weights(trainer, 0.02, seed=6)
    report = _sync(stub)
    assert report.ok, [r.error for r in report.rollouts]
    assert {r.encoding for r in report.rollouts} == {"full"}
    assert all(_exact(trainer, app) for app in rollouts.values())


def test_full_encoding_and_delta_over_another_transport(fleet):
    trainer, rollouts, stub = fleet
    orch = trainer.orch
    import grpc

    orch.delta.encoding = "full"
    try:
        change_weights(trainer, 0.02, seed=7)
        report = _sync(stub)
        assert report.ok and {r.encoding for r in report.rollouts} == {"full"}
        assert all(r.wire_bytes >= report.bytes for r in report.rollouts)
        assert orch.delta.held is None and orch.delta.held_bytes() == 0  # full keeps no copy
    finally:
        orch.delta.encoding = "delta"
    with pytest.raises(grpc.RpcError) as err:
        stub.Sync(trainer_pb2.SyncRequest(transport="ipc"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sync_encoding=delta" in err.value.details()


def test_a_rollout_that_keeps_no_base_is_sent_in_full_until_it_holds_one(fleet):
    trainer, rollouts, stub = fleet
    change_weights(trainer, 0.02, seed=11)
    assert _sync(stub).ok  # both ends hold the base, whatever the tests before left
    b = rollouts["b"].tx.delta_base
    b.enabled = False  # rollout config delta_base=false
    try:
        change_weights(trainer, 0.02, seed=8)
        report = _sync(stub)
        got = _by_id(report)
        assert report.ok and got["a"].encoding == "delta" and got["b"].encoding == "full"
        assert b.held is None and _exact(trainer, rollouts["b"])
    finally:
        b.enabled = True
    change_weights(trainer, 0.02, seed=9)
    assert {r.encoding for r in _sync(stub).rollouts} == {"delta", "full"}  # "b" builds its copy now
    change_weights(trainer, 0.02, seed=10)
    report = _sync(stub)
    assert report.ok and {r.encoding for r in report.rollouts} == {"delta"}
    assert all(_exact(trainer, app) for app in rollouts.values())
