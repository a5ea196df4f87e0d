"""The manifest goes in full once per layout and rollout; later prepares carry its digest only.

Real TrainerApp (hf backend) and RolloutApps on loopback gRPC, TCP bus. Checked: the layout is
planned once; the second sync sends no buckets in PrepareSync and still commits bit-exact
weights; a rollout that lost its layouts (a restart) answers manifest_needed and is sent the
full manifest within the same Sync; a changed layout (another bucket size) goes in full again.
"""

from __future__ import annotations

import grpc
import pytest

from tests.support.fleet_sync import bump_and_sync_exactly
from tests.support.local_apps import local_fleet
from weightsync.bus.layout import KnownLayouts
from weightsync.control.client import channel, rollout_stub
from weightsync.v1 import rollout_pb2, trainer_pb2


@pytest.fixture(scope="module")
def fleet():
    with local_fleet({"a": {"apply_mode": "staged"}, "b": {"apply_mode": "inplace"}}) as (trainer, rollouts, stub):
        sent: list[tuple[str, int]] = []  # (rollout id, buckets in the PrepareSync manifest)
        call = trainer.orch.rollouts.call

        def spy(entry, method, req):
            if method == "PrepareSync":
                sent.append((entry.rollout_id, len(req.manifest.buckets)))
            return call(entry, method, req)

        trainer.orch.rollouts.call = spy
        yield trainer, rollouts, stub, sent


def test_full_manifest_once_then_digest_then_full_again_after_restart_or_change(fleet):
    trainer, rollouts, stub, sent = fleet
    bump_and_sync_exactly(trainer, rollouts, stub)
    n_buckets = len(trainer.orch.manifests._template.buckets)
    assert n_buckets >= 1 and sorted(sent) == [("a", n_buckets), ("b", n_buckets)]
    sent.clear()
    bump_and_sync_exactly(trainer, rollouts, stub)
    assert sorted(sent) == [("a", 0), ("b", 0)] and trainer.orch.manifests.plans == 1

    # "a" restarts (its validated layouts are gone): it asks, and gets the full manifest in the same Sync
    rollouts["a"].servicer.layouts = KnownLayouts()
    sent.clear()
    bump_and_sync_exactly(trainer, rollouts, stub)
    assert sorted(sent) == [("a", 0), ("a", n_buckets), ("b", 0)]

    # another bucket size is another layout (more buckets): planned again, sent in full to everyone
    trainer.orch.bucket_bytes = 64 << 10
    sent.clear()
    bump_and_sync_exactly(trainer, rollouts, stub)
    assert trainer.orch.manifests.plans == 2 and len(sent) == 2
    assert all(n == len(trainer.orch.manifests._template.buckets) > n_buckets for _, n in sent)
    sent.clear()
    bump_and_sync_exactly(trainer, rollouts, stub)
    assert sorted(sent) == [("a", 0), ("b", 0)]


def test_unknown_digest_prepares_nothing_and_a_contradicting_one_is_refused(fleet):
    trainer, rollouts, stub, _ = fleet
    app = rollouts["a"]
    r = rollout_stub(channel(app.grpc.address), "", 10)
    held = trainer.orch.manifests.manifest(
        trainer.actor.export_metas(),
        version=99,
        sync_id="probe",
        bucket_bytes=trainer.orch.bucket_bytes,
        model_family=trainer.actor.family,
        checksum_algo="ws-sum64-v1",
        origin="x",
    )
    from weightsync.bus.layout import compact_proto

    req = rollout_pb2.PrepareSyncRequest(manifest=compact_proto(held), trainer_id=trainer.orch.trainer_id)
    req.transport.tcp.SetInParent()
    req.manifest.layout_digest = "0" * 64
    resp = r.PrepareSync(req)
    assert resp.manifest_needed and app.tx.pending_sync_id == ""
    req.manifest.layout_digest = held.layout_digest
    req.manifest.total_bytes += 256
    with pytest.raises(grpc.RpcError) as err:
        r.PrepareSync(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "differs from the layout" in err.value.details()
    assert app.tx.pending_sync_id == "" and app.tx.state == rollout_pb2.SERVING


def test_a_digest_alone_neither_lets_a_foreign_trainer_in_nor_rolls_back(fleet):
    """The digest path skips the manifest's validation, not the rollout's identity and version checks."""
    trainer, rollouts, stub, _ = fleet
    app = rollouts["a"]
    stub.Sync(trainer_pb2.SyncRequest())  # the rollout holds the current layout and serves version >= 1
    served = app.tx.version
    assert served >= 1
    r = rollout_stub(channel(app.grpc.address), "", 10)
    from weightsync.bus.layout import compact_proto

    def compact(version):
        m = trainer.orch.manifests.manifest(
            trainer.orch.export_format.metas(trainer.actor.export_metas()),
            version=version,
            sync_id=f"probe-{version}",
            bucket_bytes=trainer.orch.bucket_bytes,
            model_family=trainer.actor.family,
            checksum_algo="ws-sum64-v1",
            origin="x",
        )
        assert m.layout_digest in app.servicer.layouts._by_digest  # named by a digest the rollout holds
        return compact_proto(m)

    foreign = rollout_pb2.PrepareSyncRequest(manifest=compact(served + 1), trainer_id="someone-else")
    foreign.transport.tcp.SetInParent()
    with pytest.raises(grpc.RpcError) as err:
        r.PrepareSync(foreign)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "follows trainer" in err.value.details()
    back = rollout_pb2.PrepareSyncRequest(manifest=compact(served - 1), trainer_id=trainer.orch.trainer_id)
    back.transport.tcp.SetInParent()
    with pytest.raises(grpc.RpcError) as err:
        r.PrepareSync(back)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "allow-rollback" in err.value.details()
    assert app.tx.pending_sync_id == "" and app.tx.version == served and app.tx.state == rollout_pb2.SERVING


def test_a_rollout_that_predates_run_entries_gets_every_tensor_as_an_entry(fleet):
    trainer, rollouts, stub, _ = fleet
    forms: list[tuple[str, int, int]] = []  # (rollout id, entries, of which runs) of each full manifest sent
    call = trainer.orch.rollouts.call

    def spy(entry, method, req):
        if method == "PrepareSync" and req.manifest.buckets:
            entries = [t for b in req.manifest.buckets for t in b.tensors]
            forms.append((entry.rollout_id, len(entries), sum(1 for t in entries if t.run_count)))
        return call(entry, method, req)

    old = rollouts["b"].servicer
    trainer.orch.bucket_bytes = 64 << 20  # the model in one bucket: its alike layers make a run
    bump_and_sync_exactly(trainer, rollouts, stub)  # both hold the layout
    trainer.orch.rollouts.call = spy
    entry_b = trainer.registry.get("b")
    assert entry_b.manifest_runs  # it said so in its answers so far
    # "b" restarts as a build before run entries: its status and answers never say manifest_runs
    old.manifest_runs = False
    try:
        for app in rollouts.values():  # both lost their layouts: the next sync sends the full manifest
            app.servicer.layouts = KnownLayouts()
        # the trainer last heard "b" read runs; its manifest_needed answer says otherwise before the resend
        bump_and_sync_exactly(trainer, rollouts, stub)
        assert not entry_b.manifest_runs
        # and a rollout that registers (the trainer polls its status) is known before any prepare
        entry_b.manifest_runs = True
        trainer.registry.poll(entry_b)
        assert not entry_b.manifest_runs
    finally:
        old.manifest_runs = True
        trainer.orch.rollouts.call = call
    tensors = trainer.orch.manifests._template.num_tensors
    by_id = {rid: (n, runs) for rid, n, runs in forms}
    assert len(forms) == 2 and sorted(by_id) == ["a", "b"], forms
    assert by_id["b"] == (tensors, 0)  # plain: one entry per tensor
    n, runs = by_id["a"]
    assert runs > 0 and n < tensors  # the same layout with runs; both committed the same weights exactly
