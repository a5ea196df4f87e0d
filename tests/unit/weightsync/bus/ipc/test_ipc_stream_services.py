"""CUDA IPC through the real services, on a CPU: everything but the GPU itself.

A TrainerApp (hf backend) and RolloutApps (built-in engine) on loopback gRPC sync over
transport ipc. What a CPU cannot do is replaced at the GPU boundary only: the trainer's
`_share_cuda_` (a fake share records the buffer under a made-up handle) and the rollout's
`_new_shared_cuda` (a fake open returns that buffer: the same memory, as a real mapping would
be), and the GPU-UUID checks. Everything else is ours and real: the IpcBuckets stream with
token auth, per-bucket acknowledgements, the trainer's pooled buffers shared once for every sync,
the rollout's mappings opened once per pairing, checksums, commit and abort. The real mapping,
side stream and event are exercised by tests/gpu/test_services_gpu.py.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from tests.support.fake_gpu import GPU, FakeGpu
from tests.support.fleet_sync import assert_serves_export, bump_weights
from tests.support.local_apps import local_fleet
from weightsync.bus.ipc.handles import HandleCache, MappedBuffers
from weightsync.bus.ipc.sender import IpcStreamSender
from weightsync.bus.pack import pack_bucket
from weightsync.control.client import channel, rollout_stub, trainer_stub
from weightsync.v1 import rollout_pb2, trainer_pb2

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def fleet():
    gpu = FakeGpu()
    with local_fleet({"a": {"apply_mode": "inplace"}, "b": {"apply_mode": "staged"}}, TOKEN) as (
        trainer,
        rollouts,
        stub,
    ):
        ipc = trainer.orch.transports["ipc"]
        ipc.needs_cuda, ipc.uuid_of, ipc.cache = False, (lambda d: GPU), HandleCache(gpu.share)
        trainer.orch.bucket_bytes = 64 << 10  # several buckets: two pooled buffers take turns
        for app in rollouts.values():
            app.servicer.ipc.check = lambda spec: GPU if spec.device_uuid == GPU else "GPU-other"
            app.servicer.ipc.maps = MappedBuffers(gpu.open)
        yield trainer, rollouts, stub, gpu


def _prepared_by_hand(trainer, stub, gpu, sync_id: str, version: int):
    """PrepareSync of an ipc sync of the trainer's layout, sent to `stub` by the test itself:
    (manifest, the rollout's answer, the handle of bucket 0 packed from the trainer's weights)."""
    manifest = trainer.orch.manifests.manifest(
        trainer.actor.export_metas(),
        version=version,
        sync_id=sync_id,
        bucket_bytes=trainer.orch.bucket_bytes,
        model_family=trainer.actor.family,
        checksum_algo="ws-sum64-v1",
        origin=trainer.orch.origin,
    )
    req = rollout_pb2.PrepareSyncRequest(
        manifest=trainer.orch.manifests.full_proto(manifest), timeout_seconds=30, trainer_id=trainer.orch.trainer_id
    )
    req.transport.ipc.device_uuid = GPU
    answer = stub.PrepareSync(req)
    first = manifest.buckets[0]
    buf = torch.zeros(first.nbytes, dtype=torch.uint8)
    pack_bucket(first, iter(list(trainer.actor.export_tensors())[: len(first.slots)]), buf)
    return manifest, answer, gpu.share(buf)


def test_ipc_sync_shares_once_maps_once_and_stays_exact_across_syncs(fleet):
    trainer, rollouts, stub, gpu = fleet
    for _ in range(3):
        bump_weights(trainer)
        report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
        assert report.ok and report.transport == "ipc", [r.error for r in report.rollouts]
        assert report.num_buckets > 2
        for app in rollouts.values():
            assert_serves_export(trainer, app)
    ipc = trainer.orch.transports["ipc"]
    assert ipc.buffers.allocations == 1 and gpu.shares == 2  # two pooled buffers, shared once for three syncs
    for app in rollouts.values():
        assert app.servicer.ipc.maps.opens == 2 and len(app.servicer.ipc.maps) == 2


def test_a_corrupted_bucket_fails_that_rollout_only_and_the_next_sync_heals_it(fleet):
    trainer, rollouts, stub, gpu = fleet
    bump_weights(trainer)
    a = rollouts["a"]
    consume = a.tx.consume_bucket

    def flip_a_bit(sync_id, index, buf, checksum, **kw):  # corruption between the trainer's buffer and the engine
        if index == 1:
            buf = buf.clone()
            buf[7] ^= 1
        return consume(sync_id, index, buf, checksum, **kw)

    a.tx.consume_bucket = flip_a_bit
    try:
        report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
    finally:
        a.tx.consume_bucket = consume
    results = {r.rollout_id: r for r in report.rollouts}
    assert not results["a"].ok and "DATA_LOSS" in results["a"].error and "bucket 1" in results["a"].error, results[
        "a"
    ].error
    assert results["b"].ok
    assert_serves_export(trainer, rollouts["b"])
    # in place, bucket 0 was already loaded: STALE, refusing generation until a complete sync
    assert a.tx.state == rollout_pb2.STALE and a.tx.pending_sync_id == ""
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
    assert report.ok, [r.error for r in report.rollouts]
    assert_serves_export(trainer, a)


def test_buckets_of_the_trainers_own_storage_are_acknowledged_queued_and_checked_at_commit(fleet, monkeypatch):
    """A trainer that sends its own parameter storage (on a GPU: bf16 hf) marks each bucket
    held_until_commit; the rollouts acknowledge it without waiting for their copy and read its
    checksum at commit, where a corrupted bucket still fails that rollout alone."""
    from weightsync.publisher.stream_phase import StreamPhase

    def in_place(self):  # what a GPU trainer does; a CPU one packs (StreamPhase._in_place)
        buffers = self.fleet.actor.flat_buckets(self.manifest)
        if buffers is not None:
            self.session.use_in_place(buffers)
        return buffers

    monkeypatch.setattr(StreamPhase, "_in_place", in_place)
    trainer, rollouts, stub, gpu = fleet
    bump_weights(trainer)
    a = rollouts["a"]
    seen, push = [], a.servicer.ipc.push
    consume = a.tx.consume_bucket

    def recording_push(request):
        seen.append(request.held_until_commit)
        return push(request)

    def flip_a_bit(sync_id, index, buf, checksum, **kw):
        if index == 1:
            buf = buf.clone()
            buf[7] ^= 1
        return consume(sync_id, index, buf, checksum, **kw)

    monkeypatch.setattr(a.servicer.ipc, "push", recording_push)
    monkeypatch.setattr(a.tx, "consume_bucket", flip_a_bit)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
    results = {r.rollout_id: r for r in report.rollouts}
    assert seen and all(seen), seen
    err = results["a"].error
    assert not results["a"].ok and "commit" in err and "DATA_LOSS" in err and "bucket 1: checksum" in err, err
    assert results["b"].ok
    assert_serves_export(trainer, rollouts["b"])
    assert a.tx.state == rollout_pb2.STALE and a.tx.pending_sync_id == ""
    monkeypatch.setattr(a.tx, "consume_bucket", consume)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
    assert report.ok, [r.error for r in report.rollouts]
    for app in rollouts.values():
        assert_serves_export(trainer, app)


def test_ipc_stream_refuses_a_wrong_token_a_foreign_sync_and_a_mixed_stream(fleet):
    trainer, rollouts, _, gpu = fleet
    app = rollouts["b"]
    bad = rollout_stub(channel(app.grpc.address), "wrong", 10)
    with pytest.raises(grpc.RpcError) as err:
        list(bad.IpcBuckets(iter([rollout_pb2.PushBucketRequest(sync_id="x")])))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = rollout_stub(channel(app.grpc.address), TOKEN, 10)
    with pytest.raises(grpc.RpcError) as err:
        list(good.IpcBuckets(iter([rollout_pb2.PushBucketRequest(sync_id="never-prepared")])))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not prepared here" in err.value.details()

    # a prepared ipc sync whose stream switches to another sync id is refused and aborted
    manifest, _, h = _prepared_by_hand(trainer, good, gpu, "mixed", trainer.actor.version)
    pushes = [
        rollout_pb2.PushBucketRequest(sync_id="mixed", index=0, ipc=h),
        rollout_pb2.PushBucketRequest(sync_id="other", index=1, ipc=h),
    ]
    acks = []
    with pytest.raises(grpc.RpcError) as err:
        for ack in good.IpcBuckets(iter(pushes)):
            acks.append(ack.index)
    assert acks == [0]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "carries sync mixed" in err.value.details()
    assert app.tx.pending_sync_id == "" and app.tx.state == rollout_pb2.SERVING  # staged: aborted, still serving


def test_ipc_commits_ride_the_bucket_stream_and_a_commit_for_another_sync_on_it_is_refused(fleet, monkeypatch):
    """Both rollouts answer PrepareSync with commit_on_stream: a trainer that does not use their
    sync links commits each as the last message of its IpcBuckets stream, so no CommitSync call is
    made; a commit naming another sync than the stream's is refused and that sync aborted."""
    trainer, rollouts, _, gpu = fleet
    monkeypatch.setattr(trainer.orch.rollouts, "sync_link", False)
    stub = trainer_stub(channel(trainer.grpc.address), TOKEN, 60)
    methods, call = [], trainer.orch.rollouts.call

    def recording_call(entry, method, req):
        methods.append(method)
        return call(entry, method, req)

    monkeypatch.setattr(trainer.orch.rollouts, "call", recording_call)
    bump_weights(trainer)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
    assert report.ok, [r.error for r in report.rollouts]
    assert sorted(methods) == ["PrepareSync", "PrepareSync"]  # no CommitSync, no AbortSync
    for app in rollouts.values():
        assert_serves_export(trainer, app)
    assert {r.version for r in report.rollouts} == {trainer.actor.version}

    app = rollouts["b"]
    good = rollout_stub(channel(app.grpc.address), TOKEN, 10)
    manifest, prepared, h = _prepared_by_hand(trainer, good, gpu, "stream-commit", trainer.actor.version + 1)
    assert prepared.commit_on_stream
    foreign = rollout_pb2.CommitSyncRequest(
        sync_id="another", version=manifest.version, trainer_id=trainer.orch.trainer_id
    )
    msgs = [
        rollout_pb2.PushBucketRequest(sync_id="stream-commit", index=0, ipc=h),
        rollout_pb2.PushBucketRequest(commit=foreign),
    ]
    answers = []
    with pytest.raises(grpc.RpcError) as err:
        for ans in good.IpcBuckets(iter(msgs)):
            answers.append(ans)
    assert [a.index for a in answers] == [0] and not answers[0].HasField("commit")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "commit of sync 'another' on the IpcBuckets stream of sync 'stream-commit'" in err.value.details()
    assert app.tx.pending_sync_id == "" and app.tx.state == rollout_pb2.SERVING
    assert app.tx.version == trainer.actor.version  # staged: the old version serves on


def test_with_the_sync_link_an_ipc_sync_prepares_and_commits_there_and_ends_its_streams(fleet, monkeypatch):
    """Once a rollout's PrepareSync answer named its sync link, the next sync's prepare and commit
    go over it (no IpcBuckets stream waits for a commit: each ends after its last bucket)."""
    trainer, rollouts, stub, _ = fleet
    bump_weights(trainer)
    assert stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report.ok  # the links are known from here on
    served = {rid: app.link.requests for rid, app in rollouts.items()}
    stream_commits = []

    real = IpcStreamSender.commit_on_stream
    monkeypatch.setattr(
        IpcStreamSender, "commit_on_stream", lambda self, rids: (stream_commits.append(list(rids)), real(self, rids))[1]
    )
    bump_weights(trainer)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc")).report
    assert report.ok, [r.error for r in report.rollouts]
    assert stream_commits == []
    assert {rid: app.link.requests - served[rid] for rid, app in rollouts.items()} == {"a": 2, "b": 2}
    for app in rollouts.values():
        assert_serves_export(trainer, app)
