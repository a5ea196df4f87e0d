"""NCCL sync orchestration through the real services, over an in-process loopback instead of libnccl.

A TrainerApp (hf backend) and RolloutApps (built-in engine) run on loopback gRPC ports; only the
NCCL library is replaced (tests/support/nccl_loopback.py's LoopbackBus: same interface, no GPU). What is checked is
ours: the rank plan, the group cache keyed by membership, rebuilds after a membership change, a
failure or a restarted member, group-wide failure when a member cannot prepare or join, and the
refusal of nccl by a CPU rollout. Real NCCL runs in tests/gpu/test_services_gpu.py.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from tests.support.fleet_sync import assert_serves_export, bump_weights
from tests.support.local_apps import local_fleet
from tests.support.nccl_loopback import LoopbackBus
from weightsync.bus.nccl.sender import NcclSender
from weightsync.control.client import channel, rollout_stub
from weightsync.v1 import bus_pb2, rollout_pb2, trainer_pb2

INIT_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def fleet():
    bus = LoopbackBus()
    rollouts = {
        rid: {"apply_mode": "inplace" if rid == "b" else "staged"} for rid in ("a", "b", "c", "partitioned", "cpu")
    }
    with local_fleet(rollouts) as (trainer, apps, stub):
        trainer.orch.transports["nccl"] = NcclSender(
            torch.device("cpu"), bus, INIT_TIMEOUT, trainer.metrics.nccl_group_builds.inc
        )
        apps["partitioned"].servicer.nccl._bus = LoopbackBus()  # another network: its join never meets the others
        for rid in ("a", "b", "c"):  # "cpu" keeps the real bus: a CPU engine must refuse nccl
            apps[rid].servicer.nccl._bus = bus
        yield trainer, apps, stub, bus


def _sync(stub, ids):
    return stub.Sync(trainer_pb2.SyncRequest(rollout_ids=ids, transport="nccl")).report


def _builds(trainer, rollouts):
    return trainer.orch.transports["nccl"].cache.builds, {rid: a.servicer.nccl.builds for rid, a in rollouts.items()}


def _spec(**fields) -> bus_pb2.NcclTransport:
    """A well-formed NcclTransport for a 2-rank group; fields override."""
    return bus_pb2.NcclTransport(
        **{**dict(unique_id=bytes(128), world_size=2, rank_offset=1, group_id="g", new_group=True), **fields}
    )


def _refused_prepare(trainer, app, spec: bus_pb2.NcclTransport) -> grpc.RpcError:
    """PrepareSync straight to `app` with `spec`, which it must refuse; returns the error."""
    # sent as the fleet's trainer: the rollouts follow its id once it has synced them
    req = rollout_pb2.PrepareSyncRequest(
        timeout_seconds=5, transport=bus_pb2.TransportSpec(nccl=spec), trainer_id=trainer.trainer_id
    )
    req.manifest.CopyFrom(_manifest(trainer))
    with pytest.raises(grpc.RpcError) as e:
        rollout_stub(channel(app.grpc.address), "").PrepareSync(req, timeout=10)
    return e.value


def test_group_is_built_once_reused_and_rebuilt_on_membership_change_failure_or_restart(fleet):
    trainer, rollouts, stub, bus = fleet
    a, b, c = rollouts["a"], rollouts["b"], rollouts["c"]
    t0, r0 = _builds(trainer, rollouts)

    rep = _sync(stub, ["b", "a"])
    assert rep.ok, rep
    assert rep.transport == "nccl" and rep.version == trainer.actor.version
    assert_serves_export(trainer, a)
    assert_serves_export(trainer, b)
    # ranks follow rollout ids (a=1, b=2), whatever the request's order
    assert a.servicer.nccl.held_key()[1:] == (3, 1) and b.servicer.nccl.held_key()[1:] == (3, 2)
    group_id = a.servicer.nccl.group_id
    assert b.servicer.nccl.group_id == group_id
    assert _builds(trainer, rollouts) == (t0 + 1, {**r0, "a": r0["a"] + 1, "b": r0["b"] + 1})

    bump_weights(trainer)  # same membership: the cached group carries the next sync
    rep = _sync(stub, ["a", "b"])
    assert rep.ok, rep
    assert_serves_export(trainer, a)
    assert_serves_export(trainer, b)
    assert _builds(trainer, rollouts)[0] == t0 + 1 and a.servicer.nccl.group_id == group_id

    bump_weights(trainer)  # a new member: a new group of world size 4
    rep = _sync(stub, ["a", "b", "c"])
    assert rep.ok, rep
    for app in (a, b, c):
        assert_serves_export(trainer, app)
    assert _builds(trainer, rollouts)[0] == t0 + 2
    assert c.servicer.nccl.held_key()[1:] == (4, 3) and a.servicer.nccl.group_id != group_id

    # a communicator failure on one member: the next sync of the same membership rebuilds
    c.servicer.nccl._groups[0][0].abort("test: comm error on c")
    bump_weights(trainer)
    rep = _sync(stub, ["a", "b", "c"])
    assert rep.ok, rep
    assert_serves_export(trainer, c)
    assert _builds(trainer, rollouts)[0] == t0 + 3

    # a restarted member no longer holds the group: it refuses the reuse and one retry rebuilds
    a.servicer.nccl._groups.clear()
    bump_weights(trainer)
    rep = _sync(stub, ["a", "b", "c"])
    assert rep.ok, rep
    for app in (a, b, c):
        assert_serves_export(trainer, app)
    assert _builds(trainer, rollouts)[0] == t0 + 4


def test_member_that_cannot_join_fails_every_member_and_the_next_sync_rebuilds(fleet):
    trainer, rollouts, stub, bus = fleet
    a = rollouts["a"]
    _sync(stub, ["a"])
    before = a.tx.version
    bump_weights(trainer)
    rep = _sync(stub, ["a", "partitioned"])
    assert not rep.ok
    errors = {r.rollout_id: r.error for r in rep.rollouts}
    assert not any(r.ok for r in rep.rollouts)
    assert "did not complete within" in errors["a"] and "did not complete within" in errors["partitioned"], errors
    assert a.tx.version == before and a.tx.state == rollout_pb2.SERVING  # staged: still the old version
    rep = _sync(stub, ["a", "b"])
    assert rep.ok, rep
    assert_serves_export(trainer, a)


def test_two_ranks_on_one_gpu_are_refused_at_prepare_and_the_others_synced_without_them(fleet):
    trainer, rollouts, stub, bus = fleet
    a, b, c = rollouts["a"], rollouts["b"], rollouts["c"]
    nccl = trainer.orch.transports["nccl"]
    builds = _builds(trainer, rollouts)[0]
    sides = [nccl, a.servicer.nccl, b.servicer.nccl, c.servicer.nccl]
    real = [s.uuid_of for s in sides]
    try:
        a.servicer.nccl.uuid_of = b.servicer.nccl.uuid_of = lambda dev: "GPU-shared"
        bump_weights(trainer)
        rep = _sync(stub, ["a", "b"])
        by = {r.rollout_id: r for r in rep.rollouts}
        assert not rep.ok and sorted(by) == ["a", "b"], rep
        # whichever answered second is refused; the first is synced in a group of its own
        (ok,) = [rid for rid, r in by.items() if r.ok]
        (refused,) = [rid for rid, r in by.items() if not r.ok]
        assert f"receives on GPU GPU-shared, and so does {ok}; NCCL takes one rank per GPU" in by[refused].error, rep
        assert by[ok].version == trainer.actor.version
        assert_serves_export(trainer, rollouts[ok])
        assert rollouts[refused].tx.version != trainer.actor.version
        assert rep.seconds < INIT_TIMEOUT, "refused at prepare, without waiting for any join"
        assert _builds(trainer, rollouts)[0] == builds + 1

        nccl.uuid_of = lambda dev: "GPU-trainer"  # nor may a rollout share the trainer's GPU
        c.servicer.nccl.uuid_of = lambda dev: "GPU-trainer"
        rep = _sync(stub, ["c"])
        assert not rep.ok and "and so does the trainer" in rep.rollouts[0].error, rep
        assert _builds(trainer, rollouts)[0] == builds + 1  # nobody left to form a group with
    finally:
        for side, fn in zip(sides, real):
            side.uuid_of = fn
    for app in (a, b, c):
        assert app.tx.pending_sync_id == "" and app.tx.state == rollout_pb2.SERVING
    bump_weights(trainer)
    rep = _sync(stub, ["a", "b", "c"])  # distinct GPUs again: the group forms
    assert rep.ok, rep
    assert_serves_export(trainer, b)


def test_cpu_rollout_refuses_nccl_and_is_left_out_while_the_others_sync(fleet):
    trainer, rollouts, stub, bus = fleet

    def failures(reason):
        return (
            trainer.metrics.registry.get_sample_value(
                "weightsync_sync_failures_total", {"role": "trainer", "reason": reason}
            )
            or 0.0
        )

    before = failures("prepare_failed"), failures("transport")
    bump_weights(trainer)
    rep = _sync(stub, ["a", "cpu"])
    by = {r.rollout_id: r for r in rep.rollouts}
    assert not rep.ok and sorted(by) == ["a", "cpu"], rep
    assert "transport nccl needs a CUDA engine" in by["cpu"].error and "--device cuda:N" in by["cpu"].error, rep
    assert by["a"].ok and by["a"].version == trainer.actor.version, rep
    assert_serves_export(trainer, rollouts["a"])
    assert rollouts["cpu"].tx.pending_sync_id == "" and rollouts["cpu"].tx.version != trainer.actor.version
    # one failure (cpu's prepare); a's first, superseded attempt is not counted against it
    assert (failures("prepare_failed"), failures("transport")) == (before[0] + 1, before[1])

    err = _refused_prepare(trainer, rollouts["cpu"], _spec())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "builtin engine runs on cpu" in err.details()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("unique_id", bytes(12), "unique_id has 12 bytes"),
        ("world_size", 1, "world_size=1"),
        ("rank_offset", 0, "rank_offset=0"),
        ("rank_offset", 2, "rank_offset=2"),
        ("group_id", "", "group_id must have"),
        ("timeout_seconds", float("inf"), "timeout_seconds=inf"),
    ],
)
def test_malformed_nccl_transport_is_invalid_argument(fleet, field, value, match):
    trainer, rollouts, _, _ = fleet
    spec = _spec()
    setattr(spec, field, value)
    err = _refused_prepare(trainer, rollouts["c"], spec)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and match in err.details()


def test_reuse_of_a_group_the_rollout_does_not_hold_is_refused(fleet):
    trainer, rollouts, _, _ = fleet
    err = _refused_prepare(trainer, rollouts["c"], _spec(group_id="g-never-built", new_group=False))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "nccl group g-never-built (rank 1 of 2) is not held here" in err.details()
    assert rollouts["c"].tx.pending_sync_id == ""


def test_gpu_transports_refused_on_a_cpu_trainer(fleet):
    trainer, _, stub, _ = fleet
    with pytest.raises(
        ValueError, match=r"transport=nccl needs the trainer's export on a CUDA device.*--device cuda:0"
    ):
        NcclSender(torch.device("cpu")).begin([], "s", 1 << 20)
    with pytest.raises(grpc.RpcError) as e:
        stub.Sync(trainer_pb2.SyncRequest(rollout_ids=["a"], transport="ipc"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "transport=ipc needs the trainer's export on the rollouts' GPU" in e.value.details()


def _manifest(trainer) -> bus_pb2.Manifest:
    from weightsync.bus.plan import make_manifest, manifest_to_proto

    a = trainer.actor
    return manifest_to_proto(
        make_manifest(
            a.export_metas(), version=a.version, sync_id="manual", bucket_bytes=1 << 20, model_family=a.family
        )
    )


@pytest.mark.parametrize(
    "how, watched",
    [("dies", True), ("leaves", True), ("dies", False)],
    ids=["dead-watched", "left-watched", "dead-unwatched"],
)
def test_rollout_that_dies_mid_stream_aborts_the_group_within_a_watch_period(how, watched):
    """Real NCCL never tells the sender that a receiving process died, or that it aborted its side
    of the sync and stopped receiving: the broadcast just waits. The loopback is set to wait the
    same way (blocking_send); the member's gRPC port going away, or its status no longer naming the
    sync, is what the trainer's liveness watch sees: it cuts that member out and the live one is
    synced again without it. Unwatched, the same sync waits out its timeout."""
    import threading
    import time

    bus = LoopbackBus(blocking_send=True)
    sync_timeout = 6.0
    release = threading.Event()
    with local_fleet({"live": {}, "dying": {}}, sync_timeout_s=sync_timeout) as (trainer, apps, stub):
        trainer.orch.transports["nccl"] = NcclSender(
            torch.device("cpu"),
            bus,
            INIT_TIMEOUT,
            call=trainer.orch.rollouts.call if watched else None,
            watch_period=0.2,
        )
        for app in apps.values():
            app.servicer.nccl._bus = bus
        dying = apps["dying"]

        def hang_then_lose_the_control_plane(sync_id, receiver, sender=0):
            # joined the group, then stuck before taking any bucket; its gRPC server goes away,
            # as a killed process's port would (or it gives the sync up, alive), while its NCCL
            # rank never signals anything
            if how == "dies":
                threading.Timer(0.3, dying.grpc.stop).start()
            else:
                threading.Timer(0.3, dying.tx.abort, (sync_id, "test: a bucket failed its checksum")).start()
            release.wait(30)

        dying.tx.run_receiver = hang_then_lose_the_control_plane
        try:
            before = apps["live"].tx.version
            t0 = time.monotonic()
            rep = stub.Sync(
                trainer_pb2.SyncRequest(rollout_ids=["live", "dying"], transport="nccl"), timeout=sync_timeout + 30
            ).report
            took = time.monotonic() - t0
            errors = {r.rollout_id: r.error for r in rep.rollouts}
            by_id = {r.rollout_id: r for r in rep.rollouts}
            assert not rep.ok and not by_id["dying"].ok, rep
            if watched:
                # the member the watch found dead (or out of the sync) is cut out, and the live one is
                # synced again at once in a group without it (issue 49): it commits within this Sync
                assert took < 3.0, f"the group waited {took:.1f}s for a dead member"
                want = (
                    "rollout dying became unreachable during the stream" if how == "dies" else "rollout dying left sync"
                )
                assert want in errors["dying"], errors
                assert by_id["live"].ok and apps["live"].tx.version == rep.version != before, rep
                assert apps["live"].tx.state == rollout_pb2.SERVING
            else:
                assert not by_id["live"].ok and apps["live"].tx.version == before, rep
                assert took >= sync_timeout - 1.0, (
                    f"unwatched, the sync should have waited out its timeout ({took:.1f}s)"
                )
        finally:
            release.set()


def test_a_member_silent_mid_stream_is_cut_out_and_the_others_commit_in_the_same_sync():
    """Issue 49, single sender: a stopped member neither dies nor leaves the sync (its status still
    names it), so only its sync link tells: its NCCL rank takes no bucket and, from the same moment,
    its link thread answers no ping. After liveness_timeout_s the trainer cuts it out (aborts its
    group; the others get AbortSync) and syncs the two live members again in a group of three ranks,
    within the same Sync. The same through processes over gloo: tests/e2e/test_nccl_straggler.py."""
    import threading
    import time

    bus = LoopbackBus(blocking_send=True)
    sync_timeout = 8.0
    fleet_of = {"a": {}, "b": {}, "stopped": {}}
    with local_fleet(fleet_of, sync_timeout_s=sync_timeout, liveness_timeout_s=1.0) as (trainer, apps, stub):
        trainer.orch.transports["nccl"] = NcclSender(
            torch.device("cpu"), bus, INIT_TIMEOUT, call=trainer.orch.rollouts.call, watch_period=0.2
        )
        for app in apps.values():
            app.servicer.nccl._bus = bus
        ids = sorted(fleet_of)
        first = stub.Sync(trainer_pb2.SyncRequest(rollout_ids=ids, transport="nccl")).report
        assert first.ok, first  # and the sync links are open: the stream is watched on them
        victim, stopped, resumed = apps["stopped"], threading.Event(), threading.Event()
        limit = victim.link._limit

        def frozen_limit(kind):  # the link thread reads each frame's kind first: a stopped one answers nothing
            if stopped.is_set():
                resumed.wait(sync_timeout + 30)
            return limit(kind)

        def stuck(sync_id, receiver, sender=0):
            stopped.set()
            resumed.wait(sync_timeout + 30)

        victim.link._limit = frozen_limit
        victim.tx.run_receiver = stuck
        bump_weights(trainer)
        try:
            t0 = time.monotonic()
            rep = stub.Sync(
                trainer_pb2.SyncRequest(rollout_ids=ids, transport="nccl"), timeout=sync_timeout + 30
            ).report
            took = time.monotonic() - t0
        finally:
            resumed.set()
        by_id = {r.rollout_id: r for r in rep.rollouts}
        assert not rep.ok and not by_id["stopped"].ok, rep
        assert "silent mid-stream" in by_id["stopped"].error and "stale" in by_id["stopped"].error, rep
        assert victim.tx.version == first.version  # left on its version
        for rid in ("a", "b"):
            assert by_id[rid].ok and apps[rid].tx.version == rep.version == trainer.actor.version, rep
            assert_serves_export(trainer, apps[rid])
        assert took < 1.0 + 0.25 + 4.0, f"the live members waited {took:.1f}s (liveness_timeout_s 1 s)"
