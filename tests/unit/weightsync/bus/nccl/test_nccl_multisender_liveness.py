"""A multi-sender NCCL sync cuts out a rollout that can no longer take part within a second or so.

NCCL never tells a sender that a receiving rank died or stopped receiving: every sender's broadcast
waits until the sync's deadline. Global rank 0 is the only rank that talks to the rollouts, so it
watches them (gRPC status) and raises the sync's abort flag; every sending rank watches that flag
and aborts its own communicator. Here the whole rank-0 path is real (TrainerApp, SyncAttempt,
planning a group per sender, the watch); two threads play the two trainer ranks through
`weightsync.publisher.multisender.run_sender`; the loopback bus (tests/support/nccl_loopback.py) blocks a
broadcast until every rank took the bucket, as NCCL does. A dead rollout (its gRPC port gone) and
a live one that left the sync are both caught and cut out, and the live rollout is synced again at
once on new groups (issue 49); unwatched, the same sync waits out its deadline.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import asdict

import pytest
import torch

from tests.support.local_apps import local_fleet
from tests.support.nccl_loopback import LoopbackBus
from weightsync.bus.nccl.liveness import LocalFlags
from weightsync.bus.nccl.sender import NcclSender
from weightsync.bus.nccl.sender_groups import SenderGroupCache
from weightsync.publisher.multisender import SendJob, run_sender
from weightsync.publisher.source import WeightSource
from weightsync.v1 import rollout_pb2, trainer_pb2

SYNC_TIMEOUT = 8.0
PERIOD = 0.2


class _Rank(WeightSource):
    """One trainer rank's view of the hf actor: every tensor's metadata and owner, its own tensors."""

    def __init__(self, rank: int, actor, owners: list[int], bus, flags):
        self.rank, self.actor, self.owners, self.stream_flags = rank, actor, owners, flags
        self.rank_sync_state().nccl_groups = SenderGroupCache(bus)

    def export_metas(self):
        return self.actor.export_metas()

    def export_owners(self):
        return list(self.owners)

    def export_own_tensors(self, stats=None):
        for (name, t), owner in zip(self.actor.export_tensors(), self.owners):
            if owner == self.rank:
                yield name, t

    def parameters(self):
        return iter(())  # exports on the CPU


class TwoRankActor:
    """The hf actor as a two-rank trainer: the first half of the tensors rank 0's, the rest rank 1's
    (every other ability is the hf actor's: a WeightSource)."""

    def __init__(self, actor, bus, watched: bool):
        self._actor = actor
        n = len(actor.export_metas())
        self._owners = [0] * (n // 2) + [1] * (n - n // 2)
        self.stream_flags = LocalFlags() if watched else None
        self.ranks = [_Rank(r, actor, self._owners, bus, self.stream_flags) for r in (0, 1)]

    def __getattr__(self, name):
        return getattr(self._actor, name)

    def export_owners(self):
        return list(self._owners)

    def run_senders(self, job: dict) -> list[dict]:
        results: list = [None, None]

        def go(r: int) -> None:
            results[r] = asdict(run_sender(self.ranks[r], SendJob.from_args(job)))

        threads = [threading.Thread(target=go, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SYNC_TIMEOUT + 30)
        return results


@pytest.fixture
def fleet():
    with contextlib.ExitStack() as made:

        def make(watched: bool, **trainer_fields):
            bus = LoopbackBus(blocking_send=True)
            trainer, apps, stub = fleet = made.enter_context(
                local_fleet({"live": {}, "victim": {}}, sync_timeout_s=SYNC_TIMEOUT, **trainer_fields)
            )
            trainer.orch.actor = TwoRankActor(trainer.actor, bus, watched)
            trainer.orch.transports["nccl"] = NcclSender(
                torch.device("cpu"), bus, 5.0, call=trainer.orch.rollouts.call, watch_period=PERIOD
            )
            for app in apps.values():
                app.servicer.nccl._bus = bus
            return fleet

        yield make


def _sync(stub) -> tuple[trainer_pb2.SyncReport, float]:
    t0 = time.monotonic()
    rep = stub.Sync(
        trainer_pb2.SyncRequest(rollout_ids=["live", "victim"], transport="nccl", senders="all"),
        timeout=SYNC_TIMEOUT + 30,
    ).report
    return rep, time.monotonic() - t0


def test_both_senders_stream_their_own_groups_when_nothing_goes_wrong(fleet):
    trainer, apps, stub = fleet(watched=True)
    rep, _ = _sync(stub)
    assert rep.ok and sorted(s.rank for s in rep.senders) == [0, 1], rep
    for app in apps.values():
        assert app.tx.version == rep.version and app.tx.state == rollout_pb2.SERVING
        for name, t in trainer.actor.export_tensors():
            assert torch.equal(app.engine._target(name), t), name
    assert trainer.orch.actor.stream_flags.raised(rep.sync_id) == ""  # a good sync raises nothing


@pytest.mark.parametrize(
    "how, watched",
    [("dies", True), ("leaves", True), ("dies", False)],
    ids=["dead-watched", "left-watched", "dead-unwatched"],
)
def test_a_rollout_that_cannot_take_part_ends_every_senders_stream(fleet, how, watched):
    trainer, apps, stub = fleet(watched)
    first, _ = _sync(stub)
    assert first.ok, first
    victim, release = apps["victim"], threading.Event()

    def stuck(sync_id, receiver, sender=0):
        # joined this sender's group, then takes no bucket; either its process goes away (its gRPC
        # port with it) or it gives up on the sync on its own, both while its NCCL rank says nothing
        if sender == 0:
            if how == "dies":
                threading.Timer(0.3, victim.grpc.stop).start()
            else:
                threading.Timer(0.3, victim.tx.abort, (sync_id, "test: a bucket failed its checksum")).start()
        release.wait(SYNC_TIMEOUT + 30)

    held = {r.rank: r.rank_sync_state().nccl_groups.group_id for r in trainer.orch.actor.ranks}
    victim.tx.run_receiver = stuck
    with torch.no_grad():
        for p in trainer.actor.model.parameters():
            p.add_(0.01)
    trainer.actor.version += 1
    try:
        rep, took = _sync(stub)
    finally:
        release.set()
    errors = {r.rollout_id: r.error for r in rep.rollouts}
    by_id = {r.rollout_id: r for r in rep.rollouts}
    assert not rep.ok and not by_id["victim"].ok, rep
    live = apps["live"]
    if not watched:
        assert not by_id["live"].ok, rep
        for _ in range(100):  # the live rollout aborts once its receives fail
            if not live.tx.pending_sync_id:
                break
            time.sleep(0.05)
        assert live.tx.version == first.version and live.tx.state == rollout_pb2.SERVING
        assert not live.tx.pending_sync_id
        assert took >= SYNC_TIMEOUT - 1.5, f"unwatched, the senders should have waited out the deadline ({took:.1f}s)"
        return
    assert took < 4.0, f"the senders waited {took:.1f}s for a rollout that could not take part"
    want = "rollout victim became unreachable" if how == "dies" else "rollout victim left sync"
    assert want in errors["victim"], errors
    # the victim was cut out: rank 0 raised the first attempt's flag naming it, every sender aborted its
    # group, and the live rollout was synced again at once on new groups (issue 49)
    assert by_id["live"].ok and live.tx.version == rep.version == trainer.actor.version, rep
    assert live.tx.state == rollout_pb2.SERVING
    assert trainer.orch.actor.stream_flags.raised(rep.sync_id) == ""  # the restart raised nothing
    assert all(r.rank_sync_state().nccl_groups.group_id not in ("", held[r.rank]) for r in trainer.orch.actor.ranks)
    # the next sync without the victim reuses those groups and goes through
    again = stub.Sync(
        trainer_pb2.SyncRequest(rollout_ids=["live"], transport="nccl", senders="all"), timeout=SYNC_TIMEOUT + 30
    ).report
    assert again.ok and live.tx.version == again.version == trainer.actor.version, again


def test_a_rollout_silent_mid_stream_is_cut_out_of_every_senders_group_and_the_other_commits(fleet):
    """A stopped process (SIGSTOP) neither dies nor leaves the sync: its gRPC status would still name
    it (here: it does), so only its sync link's silence tells. The victim's NCCL rank takes no bucket
    and, from the same moment, its link thread answers no ping (as a stopped process's): after
    liveness_timeout_s rank 0 cuts it out (the sync's abort flag ends both senders' broadcasts) and
    the live rollout is synced again at once on new groups, in the same Sync (issue 49)."""
    trainer, apps, stub = fleet(watched=True, liveness_timeout_s=1.0)
    first, _ = _sync(stub)  # opens the sync links (the stream is watched on them)
    assert first.ok, first
    held = {r.rank: r.rank_sync_state().nccl_groups.group_id for r in trainer.orch.actor.ranks}
    victim, stopped, resumed = apps["victim"], threading.Event(), threading.Event()
    limit = victim.link._limit

    def frozen_limit(kind):  # the link thread reads a frame's kind first: a stopped one answers nothing
        if stopped.is_set():
            resumed.wait(SYNC_TIMEOUT + 30)
        return limit(kind)

    def stuck(sync_id, receiver, sender=0):
        stopped.set()  # joined this sender's group, then stops: no bucket taken, no ping answered
        resumed.wait(SYNC_TIMEOUT + 30)

    victim.link._limit = frozen_limit
    victim.tx.run_receiver = stuck
    with torch.no_grad():
        for p in trainer.actor.model.parameters():
            p.add_(0.01)
    trainer.actor.version += 1
    try:
        rep, took = _sync(stub)
    finally:
        resumed.set()
    by_id = {r.rollout_id: r for r in rep.rollouts}
    assert not rep.ok and not by_id["victim"].ok, rep
    assert "silent mid-stream" in by_id["victim"].error and "stale" in by_id["victim"].error, by_id["victim"]
    live = apps["live"]
    assert by_id["live"].ok and live.tx.version == rep.version == trainer.actor.version, rep
    for name, t in trainer.actor.export_tensors():
        assert torch.equal(live.engine._target(name), t), name
    assert took < 1.0 + 0.25 + 4.0, f"the live rollout waited {took:.1f}s (liveness_timeout_s 1 s)"
    assert all(r.rank_sync_state().nccl_groups.group_id not in ("", held[r.rank]) for r in trainer.orch.actor.ranks)
