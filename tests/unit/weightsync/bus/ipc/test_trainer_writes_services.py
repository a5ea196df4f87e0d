"""CUDA IPC with the trainer writing into the engine, through the real services on a CPU.

One TrainerApp (hf) and one RolloutApp (built-in engine, inplace) on loopback: the rollout offers its
parameters' table at PrepareSync, the trainer validates and maps it, writes every bucket into the
engine and commits with the sums of what it wrote. Only the GPU boundary is faked: the rollout's
`_share_cuda_` of its parameters' storage and the trainer's `_new_shared_cuda` (a handle maps back to
the same memory, as a real mapping would), and the GPU-UUID checks. tests/gpu/test_trainer_writes_gpu.py
runs the real handles and kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.fake_gpu import FakeGpu, fake_gpu_boundary
from tests.support.fleet_sync import assert_serves_export, bump_weights, rollout_calls
from tests.support.local_apps import local_fleet
from weightsync.bus.copy.checksum import bucket_checksum, combine
from weightsync.bus.pack import pack_bucket
from weightsync.v1 import bus_pb2, rollout_pb2, trainer_pb2

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def pair():
    gpu = FakeGpu()
    with local_fleet({"a": {"apply_mode": "inplace"}}, TOKEN) as (trainer, rollouts, stub):
        fake_gpu_boundary(trainer, rollouts["a"], gpu)
        trainer.orch.bucket_bytes = 64 << 10  # several buckets
        yield trainer, rollouts["a"], stub, gpu


def _expected_weights_checksum(trainer) -> int:
    """combine() of each bucket's checksum as the buckets are packed: what every path must agree on."""
    m = trainer.orch.manifests.manifest(
        trainer.actor.export_metas(),
        version=trainer.actor.version,
        sync_id="ref",
        bucket_bytes=trainer.orch.bucket_bytes,
        checksum_algo="ws-sum64-v1",
    )
    it = iter(list(trainer.actor.export_tensors()))
    sums = []
    for plan in m.buckets:
        buf = torch.zeros(plan.nbytes, dtype=torch.uint8)
        pack_bucket(plan, (next(it) for _ in plan.slots), buf)
        sums.append(bucket_checksum(buf))
    return combine(sums)


def _sync(stub):
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
    assert report.ok, [r.error for r in report.rollouts]
    return report


def test_the_trainer_writes_every_sync_exactly_with_the_table_shared_and_mapped_once(pair):
    trainer, app, stub, gpu = pair
    for i in range(3):
        bump_weights(trainer)
        report = _sync(stub)
        assert "stream.trainer_writes" in report.phase_seconds and report.num_buckets > 2
        parts = {k: v for k, v in report.phase_seconds.items() if k.startswith("stream.trainer_writes.")}
        assert set(parts) >= {"stream.trainer_writes.wait", "stream.trainer_writes.read"}, report.phase_seconds
        assert sum(parts.values()) <= report.phase_seconds["stream.trainer_writes"]  # parts of the write pass
        assert_serves_export(trainer, app)
        assert app.tx.weights_checksum == _expected_weights_checksum(trainer)
        if i == 0:
            shares, opens = gpu.shares, gpu.opens
            assert shares > 0 and opens == shares  # every allocation of the table shared and mapped once
    assert (gpu.shares, gpu.opens) == (shares, opens)  # later syncs named the table by id
    assert app.servicer.ipc.maps.opens == 0  # the rollout mapped nothing of the trainer's


def test_rollout_reads_keeps_the_old_path_with_the_same_checksums(pair, monkeypatch):
    trainer, app, stub, _ = pair
    bump_weights(trainer)
    _sync(stub)
    written = app.tx.weights_checksum
    monkeypatch.setattr(trainer.orch.transports["ipc"], "direction", "rollout_reads")
    report = _sync(stub)  # the same version, the rollout copying out of the trainer's buffers
    assert "stream.trainer_writes" not in report.phase_seconds
    assert app.servicer.ipc.maps.opens > 0
    assert_serves_export(trainer, app)
    assert app.tx.weights_checksum == written


def test_a_wrong_destination_table_is_refused_at_prepare_naming_the_tensor_and_the_next_sync_heals(pair):
    trainer, app, stub, _ = pair
    bump_weights(trainer)
    _sync(stub)
    ipc_end, sender = app.servicer.ipc, trainer.orch.transports["ipc"]
    ((key, (table_id, table)),) = ipc_end._offers.items()
    bad = bus_pb2.IpcDestinations()
    bad.CopyFrom(table)
    bad.tensors[1].dtype = bus_pb2.FLOAT16 if bad.tensors[1].dtype != bus_pb2.FLOAT16 else bus_pb2.FLOAT32
    ipc_end._offers[key] = ("bad-" + table_id, bad)
    bump_weights(trainer)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
    assert not report.ok
    (r,) = report.rollouts
    assert f"tensor {bad.tensors[1].name}: destination dtype" in r.error and "refused" in r.error, r.error
    # the rollout had paused for the writes: STALE until a complete sync commits, the trainer holds no table
    assert app.tx.state == rollout_pb2.STALE and "a" not in sender.dests
    ipc_end._offers.clear()
    _sync(stub)
    assert_serves_export(trainer, app)


def test_only_an_inplace_rollout_of_an_unquantized_layout_offers_a_table(pair):
    """Staged apply keeps the old version serving while bytes arrive: it offers no table (nor does a
    manifest without a layout digest, which could not name one)."""
    trainer, app, _, _ = pair
    m = trainer.orch.manifests.manifest(
        trainer.actor.export_metas(), version=1, sync_id="s", bucket_bytes=trainer.orch.bucket_bytes
    )
    assert m.layout_digest and app.servicer.ipc.destinations(m) is not None
    app.tx.apply_mode, mode = "staged", app.tx.apply_mode
    try:
        assert app.servicer.ipc.destinations(m) is None
    finally:
        app.tx.apply_mode = mode
    assert app.servicer.ipc.destinations(dataclasses.replace(m, layout_digest="")) is None


def test_a_rebuilt_table_gets_a_new_id_even_at_the_same_addresses(pair):
    """A restarted rollout may place its parameters at the same addresses: the trainer's old mapping
    would then write into the dead process's memory. Each table built carries a fresh token."""
    trainer, app, stub, _ = pair
    m = trainer.orch.manifests.manifest(
        trainer.actor.export_metas(), version=1, sync_id="s", bucket_bytes=trainer.orch.bucket_bytes
    )
    first = app.servicer.ipc.destinations(m)
    assert app.servicer.ipc.destinations(m)[0] == first[0]  # cached while the layout and engine stay
    app.servicer.ipc._offers.clear()  # as a restart (or a rebuilt engine) would: the same parameters
    again = app.servicer.ipc.destinations(m)
    assert again[0] != first[0] and again[1] == first[1]


def test_a_sync_call_names_its_own_direction_and_the_table_stays_mapped_across(pair):
    """SyncRequest.ipc_direction overrides the trainer's ipc_direction for one sync (a baseline in the
    same run, an operator's one-off independent read): alternating, the trainer keeps the rollout's
    table mapped and neither side shares anything again."""
    trainer, app, stub, _ = pair
    bump_weights(trainer)
    _sync(stub)  # the table is shared and mapped (if no earlier test did)
    held = trainer.orch.transports["ipc"].dests["a"]
    for direction in ("rollout_reads", "trainer_writes", "rollout_reads", "auto"):
        report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc", ipc_direction=direction)).report
        assert report.ok, [r.error for r in report.rollouts]
        assert ("stream.trainer_writes" in report.phase_seconds) == (direction != "rollout_reads"), direction
        assert_serves_export(trainer, app)
        assert app.tx.weights_checksum == _expected_weights_checksum(trainer)
    assert trainer.orch.transports["ipc"].direction == "auto"  # the configured one is left as it was
    assert trainer.orch.transports["ipc"].dests["a"] is held  # the engine's table was not offered nor mapped again


@pytest.mark.parametrize(
    "request_fields, message",
    [
        ({"transport": "ipc", "ipc_direction": "sideways"}, "ipc_direction='sideways' must be auto, rollout_reads"),
        ({"transport": "tcp", "ipc_direction": "rollout_reads"}, "applies to transport ipc; this sync runs over tcp"),
    ],
)
def test_a_direction_that_cannot_apply_is_refused_naming_the_field(pair, request_fields, message):
    import grpc

    _, _, stub, _ = pair
    with pytest.raises(grpc.RpcError) as err:
        stub.Sync(trainer_pb2.SyncRequest(**request_fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_once_the_link_is_open_prepare_and_commit_of_every_sync_go_over_it(pair):
    """The one target's PrepareSync is sent on the sync's own thread over the link (attempt.py
    `_prepare_answers`), its commit too: no gRPC call in a steady-state trainer_writes sync."""
    trainer, app, stub, _ = pair
    _sync(stub)  # an earlier prepare named the link
    before = rollout_calls(trainer)
    for _ in range(2):
        bump_weights(trainer)
        _sync(stub)
        assert_serves_export(trainer, app)
    after = rollout_calls(trainer)
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    assert delta == {("PrepareSync", "link"): 2, ("CommitSync", "link"): 2}
