"""A rollout taking one NCCL group per sending trainer rank (a multi-sender sync), over the
in-process loopback in place of libnccl (tests/support/nccl_loopback.py).

Two threads play two trainer ranks: each joins its own group as its rank 0 and streams the
buckets the manifest assigns it, concurrently. Checked: the rollout joins both groups at the rank
the trainer gave it, commits the exact weights, reuses both groups on the next sync, aborts the
whole sync (and drops every group) when one sender's group fails, and refuses malformed
sender_groups before anything is prepared. The multi-process version (torchrun trainer ranks,
rollout processes, a gloo stand-in for NCCL) is tests/e2e/test_nccl_multisender_e2e.py.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import grpc
import pytest

from tests.support.fleet_sync import assert_serves_export, bump_weights
from tests.support.nccl_loopback import LoopbackBus
from weightsync.bus.channel import BucketSender
from weightsync.bus.copy.checksum import ALGO
from weightsync.bus.pipeline import stream_buckets
from weightsync.bus.plan import make_manifest, manifest_to_proto
from weightsync.control.client import channel, rollout_stub
from weightsync.v1 import bus_pb2, rollout_pb2

TIMEOUT = 5.0


@pytest.fixture(scope="module")
def setup():
    from tests.support.local_apps import start_rollout, start_trainer

    trainer = start_trainer()  # its actor's export only: nothing here syncs through it
    bus = LoopbackBus(blocking_send=True)
    try:
        app = start_rollout("r")
    except BaseException:
        trainer.stop()
        raise
    app.servicer.nccl._bus = bus  # before any prepare: the rollout's NCCL end over the loopback
    yield trainer, app, bus
    app.stop()
    trainer.stop()


def _manifest(trainer, sync_id: str):
    """The trainer's weights as a 2-sender manifest: the first half of the tensors from rank 0."""
    metas = trainer.actor.export_metas()
    owners = [0 if i < len(metas) // 2 else 1 for i in range(len(metas))]
    m = make_manifest(
        metas,
        version=trainer.actor.version,
        sync_id=sync_id,
        bucket_bytes=64 << 10,
        model_family=trainer.actor.family,
        checksum_algo=ALGO,
        owners=owners,
    )
    assert m.senders == [0, 1] and len(m.buckets_of(0)) > 1 and len(m.buckets_of(1)) > 1
    return m, owners


def _spec(groups, **fields) -> bus_pb2.NcclTransport:
    spec = bus_pb2.NcclTransport(world_size=2, rank_offset=1, timeout_seconds=TIMEOUT, **fields)
    for sender, uid, gid, new in groups:
        spec.sender_groups.add(sender=sender, unique_id=uid, group_id=gid, new_group=new)
    return spec


def _prepare(trainer, app, manifest, spec):
    req = rollout_pb2.PrepareSyncRequest(
        timeout_seconds=30, transport=bus_pb2.TransportSpec(nccl=spec), trainer_id=trainer.trainer_id
    )
    req.manifest.CopyFrom(manifest_to_proto(manifest))
    return rollout_stub(channel(app.grpc.address), "").PrepareSync(req, timeout=10)


def _stream(trainer, bus, manifest, owners, uids, groups_held=None, fail_sender=None):
    """Each sender rank in a thread: join (or reuse) its group, stream its buckets; their checksums."""
    tensors = list(trainer.actor.export_tensors())
    out, errors, groups_held = {}, {}, groups_held if groups_held is not None else {}

    def rank(s: int) -> None:
        try:
            group = groups_held.get(s) or bus.open_group(uids[s], 2, 0, "cpu", TIMEOUT)
            groups_held[s] = group
            mine = iter(t for t, o in zip(tensors, owners) if o == s)
            sender = bus.sender(group)
            if s == fail_sender:

                class Dies(BucketSender):  # streams one bucket, then its communicator breaks
                    releases_previous = False

                    def __init__(self):
                        self.n = 0

                    def send(self, plan, buf, checksum):
                        if self.n == 1:
                            group.abort("test: sender rank died")
                            raise RuntimeError("sender rank died")
                        self.n += 1
                        sender.send(plan, buf, checksum)

                sender = Dies()
            stats = stream_buckets(replace(manifest, buckets=manifest.buckets_of(s)), mine, sender, timeout=TIMEOUT)
            out.update({b.index: c for b, c in zip(manifest.buckets_of(s), stats.checksums)})
        except Exception as exc:  # noqa: BLE001 — reported to the test
            errors[s] = exc

    threads = [threading.Thread(target=rank, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, errors, groups_held


def _commit(trainer, app, manifest, checksums):
    req = rollout_pb2.CommitSyncRequest(
        sync_id=manifest.sync_id, version=manifest.version, trainer_id=trainer.trainer_id
    )
    for i in range(len(manifest.buckets)):
        req.checksums.add(index=i, checksum=checksums[i])
    return rollout_stub(channel(app.grpc.address), "").CommitSync(req, timeout=10)


def test_two_senders_stream_concurrently_on_their_own_groups_reuse_them_and_one_failure_aborts_all(setup):
    trainer, app, bus = setup
    nccl = app.servicer.nccl
    bump_weights(trainer)
    m, owners = _manifest(trainer, "ms-1")
    uids = {0: bus.new_unique_id(), 1: bus.new_unique_id()}
    resp = _prepare(trainer, app, m, _spec([(0, uids[0], "g0", True), (1, uids[1], "g1", True)]))
    assert resp.transport.nccl.group_id == "" and resp.transport.nccl.rank_offset == 1
    sums, errors, held = _stream(trainer, bus, m, owners, uids)
    assert not errors, errors
    assert _commit(trainer, app, m, sums).version == trainer.actor.version
    assert_serves_export(trainer, app)
    assert nccl.held_senders() == [0, 1] and nccl.held_key(1) == ("g1", 2, 1) and nccl.builds == 2

    # the next sync reuses both communicators
    bump_weights(trainer)
    m2, _ = _manifest(trainer, "ms-2")
    _prepare(trainer, app, m2, _spec([(0, uids[0], "g0", False), (1, uids[1], "g1", False)]))
    sums, errors, held = _stream(trainer, bus, m2, owners, uids, held)
    assert not errors, errors
    _commit(trainer, app, m2, sums)
    assert_serves_export(trainer, app)
    assert nccl.builds == 2

    # sender 1's group breaks after one bucket: the whole sync aborts, both groups are dropped
    served = app.tx.version
    bump_weights(trainer)
    m3, _ = _manifest(trainer, "ms-3")
    _prepare(trainer, app, m3, _spec([(0, uids[0], "g0", False), (1, uids[1], "g1", False)]))
    _, errors, _ = _stream(trainer, bus, m3, owners, uids, held, fail_sender=1)
    assert 1 in errors
    for _ in range(100):
        if app.tx.pending_sync_id == "" and not nccl.held_senders():
            break
        threading.Event().wait(0.05)
    assert app.tx.pending_sync_id == "" and app.tx.version == served and app.tx.state == rollout_pb2.SERVING
    assert "aborted" in app.tx.last_error and nccl.held_senders() == []
    # reusing a dropped group is refused: the trainer has to plan new ones
    with pytest.raises(grpc.RpcError) as e:
        _prepare(
            trainer, app, _manifest(trainer, "ms-4")[0], _spec([(0, uids[0], "g0", False), (1, uids[1], "g1", False)])
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "g0 (rank 1 of 2) is not held" in e.value.details()


@pytest.mark.parametrize(
    "groups, fields, match",
    [
        ([(0, bytes(128), "a", True), (0, bytes(128), "b", True)], {}, "sender=0: each sending rank"),
        ([(0, bytes(128), "a", True), (1, bytes(128), "a", True)], {}, "group_id='a' names two groups"),
        ([(0, bytes(128), "a", True), (1, bytes(7), "b", True)], {}, "sender_groups[1].unique_id has 7 bytes"),
        (
            [(0, bytes(128), "a", True), (1, bytes(128), "b", True)],
            {"group_id": "x"},
            "sets sender_groups and the single-group fields",
        ),
        (
            [(0, bytes(128), "a", True)],
            {},
            "names groups for sender ranks [0], and the manifest's buckets come from [0, 1]",
        ),
    ],
)
def test_malformed_sender_groups_are_invalid_argument_before_anything_is_prepared(setup, groups, fields, match):
    trainer, app, _ = setup
    m, _ = _manifest(trainer, "bad")
    with pytest.raises(grpc.RpcError) as e:
        _prepare(trainer, app, m, _spec(groups, **fields))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details()
    assert app.tx.pending_sync_id == ""
