"""CommitSync goes out once the last bucket was handed to the bus, before that bucket arrived (issue 48).

Through the real services over the NCCL loopback (tests/support/nccl_loopback.py), with a trainer
sender that holds its last broadcast, as a GPU's last broadcast is still on the wire when the trainer
has enqueued it: the flush that completes it waits until the rollout has the CommitSync in hand. So
an early commit is checked by order (the sync could not end otherwise), not by timing. The rollout
commits only once the held bucket arrived and matched; when the last broadcast fails instead, the
commit sent early is refused and the rollout keeps its version and its weights.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.support.bus_proxy import BusProxy
from tests.support.fleet_sync import assert_serves_export, bump_and_sync_exactly, bump_weights, rollout_calls
from tests.support.local_apps import local_fleet
from tests.support.nccl_loopback import LoopbackBus, LoopbackSender
from weightsync.bus.errors import TransportError
from weightsync.bus.nccl.sender import NcclSender
from weightsync.local.procs import free_port
from weightsync.v1 import rollout_pb2, trainer_pb2

WAIT_S = 10.0


class _LastHeldSender(LoopbackSender):
    """A broadcast completes only once the next is enqueued (NCCL's order); the last one, at the flush,
    only once the rollout received CommitSync; or it fails then, when the bus says so."""

    releases_previous = True

    def __init__(self, group, bus: "_HeldBus"):
        super().__init__(group)
        self.bus, self._held = bus, None

    def send(self, plan, buf, checksum) -> None:
        if self._held is not None:
            super().send(*self._held)
        self._held = (plan, buf[: plan.nbytes].clone(), checksum)

    def flush(self) -> None:
        held, self._held = self._held, None
        self.bus.commit_before_last.append(self.bus.commit_seen.wait(WAIT_S))
        if self.bus.break_last:
            self.group.abort("test: the last broadcast failed")
            raise TransportError("NCCL broadcast failed: test: the last broadcast failed")
        if held is not None:
            super().send(*held)


class _HeldBus(LoopbackBus):
    def __init__(self):
        super().__init__()
        self.commit_seen = threading.Event()
        self.commit_before_last: list[bool] = []
        self.break_last = False

    def sender(self, group) -> _LastHeldSender:
        return _LastHeldSender(group, self)


@pytest.fixture(scope="module")
def fleet():
    bus = _HeldBus()
    # full syncs: a framed (delta) stream waits on each broadcast as it sends it, and holds nothing back
    with local_fleet({"a": {"apply_mode": "staged"}}, sync_encoding="full") as (trainer, apps, stub):
        trainer.orch.transports["nccl"] = NcclSender(torch.device("cpu"), bus, 5.0)
        app = apps["a"]
        app.servicer.nccl._bus = bus
        trainer.orch.bucket_bytes = 64 << 10  # several buckets
        commit = app.servicer.CommitSync  # the attribute the sync link and gRPC both call

        def seen_commit(request, *context):
            bus.commit_seen.set()
            return commit(request, *context)

        app.servicer.CommitSync = seen_commit
        yield trainer, app, stub, bus


def _sync(stub, bus) -> trainer_pb2.SyncReport:
    bus.commit_seen.clear()
    bus.commit_before_last.clear()
    return stub.Sync(trainer_pb2.SyncRequest(transport="nccl")).report


def test_commit_goes_out_before_the_last_broadcast_completes_and_applies_once_it_arrived(fleet):
    trainer, app, stub, bus = fleet
    bump_weights(trainer)
    assert _sync(stub, bus).ok  # the first: the group is built, the link opened, the layout sent
    before = rollout_calls(trainer)
    for _ in range(2):
        bump_weights(trainer)
        report = _sync(stub, bus)
        assert report.ok, [r.error for r in report.rollouts]
        assert bus.commit_before_last == [True]  # the rollout had CommitSync before the last bucket went out
        assert_serves_export(trainer, app)  # ... and committed only once it arrived: every weight exact
    now = rollout_calls(trainer)
    # still one PrepareSync and one CommitSync per sync, both on the link; no AbortSync
    assert {k: n - before.get(k, 0) for k, n in now.items() if n != before.get(k, 0)} == {
        ("PrepareSync", "link"): 2,
        ("CommitSync", "link"): 2,
    }
    assert app.servicer.nccl.builds == 1  # the cached group carried every sync


def test_a_last_broadcast_that_fails_after_the_commit_went_out_leaves_the_old_version(fleet):
    trainer, app, stub, bus = fleet
    bump_weights(trainer)
    assert _sync(stub, bus).ok
    old_version = app.tx.version
    old = {name: app.engine._target(name).clone() for name, _ in trainer.actor.export_tensors()}
    before = rollout_calls(trainer)
    bump_weights(trainer)
    bus.break_last = True
    try:
        report = _sync(stub, bus)
    finally:
        bus.break_last = False
    assert bus.commit_before_last == [True]
    assert not report.ok
    (r,) = report.rollouts
    assert "the last broadcast failed" in r.error, r.error
    # the commit sent early was refused: the old version, every weight as it was, serving
    assert app.tx.version == old_version != trainer.actor.version
    assert app.tx.state == rollout_pb2.SERVING
    for name, t in old.items():
        assert torch.equal(app.engine._target(name), t), name
    now = rollout_calls(trainer)
    calls = {k: n - before.get(k, 0) for k, n in now.items() if n != before.get(k, 0)}
    # the abort went over gRPC while the link carried the commit, then once more on the link for the reason
    assert calls == {
        ("PrepareSync", "link"): 1,
        ("CommitSync", "link"): 1,
        ("AbortSync", "grpc"): 1,
        ("AbortSync", "link"): 1,
    }, calls
    # the next sync rebuilds the group and commits
    bump_weights(trainer)
    report = _sync(stub, bus)
    assert report.ok, [r.error for r in report.rollouts]
    assert_serves_export(trainer, app)


@pytest.fixture(scope="module")
def tcp_fleet():
    dport = free_port()
    proxy = BusProxy("127.0.0.2", dport, ("127.0.0.1", dport))
    rollout = {"r": {"data_address": f"127.0.0.1:{dport}", "advertise_data_host": "127.0.0.2"}}
    try:
        with local_fleet(rollout, sync_encoding="full") as (trainer, apps, stub):
            trainer.orch.bucket_bytes = 64 << 10  # several buckets
            app, seen = apps["r"], threading.Event()
            commit = app.servicer.CommitSync

            def seen_commit(request, *context):
                seen.set()
                return commit(request, *context)

            app.servicer.CommitSync = seen_commit
            yield trainer, app, stub, proxy, seen
    finally:
        proxy.close()


def test_a_tcp_stream_whose_last_bytes_never_arrive_after_the_commit_went_out_leaves_the_old_version(tcp_fleet):
    trainer, app, stub, proxy, seen = tcp_fleet
    bump_and_sync_exactly(trainer, {"r": app}, stub)  # the link is open, the layout sent
    proxy.set("pass")
    bump_and_sync_exactly(trainer, {"r": app}, stub)
    stream_bytes = proxy.links.sent[0]  # what a full sync of this layout puts on the bus
    old_version = app.tx.version
    old = {name: app.engine._target(name).clone() for name, _ in trainer.actor.export_tensors()}
    held = []

    def cut_before_the_last_bytes() -> None:
        # the proxy holds the chunk with the stream's last byte until the rollout has the commit, then cuts
        held.append(seen.wait(WAIT_S))
        raise OSError("test: the link broke before the last bucket's end")

    proxy.set("pass")
    proxy.links.hooks.append((0, stream_bytes, cut_before_the_last_bytes))
    seen.clear()
    before = rollout_calls(trainer)
    bump_weights(trainer)
    report = stub.Sync(trainer_pb2.SyncRequest(transport="tcp")).report
    proxy.set("pass")
    assert held == [True]  # CommitSync reached the rollout while its last bytes were held
    assert not report.ok
    (r,) = report.rollouts
    assert r.error.startswith("commit: "), r.error  # the trainer's sends had all gone out: the commit refused
    assert app.tx.version == old_version != trainer.actor.version
    assert app.tx.state == rollout_pb2.SERVING
    for name, t in old.items():
        assert torch.equal(app.engine._target(name), t), name
    now = rollout_calls(trainer)
    calls = {k: n - before.get(k, 0) for k, n in now.items() if n != before.get(k, 0)}
    assert calls == {("PrepareSync", "link"): 1, ("CommitSync", "link"): 1, ("AbortSync", "link"): 1}, calls
    bump_and_sync_exactly(trainer, {"r": app}, stub)
