"""A catch-up sync queued while another sync runs is re-checked once it holds the sync lock.

Rollouts re-register every heartbeat; one that registers during a sync is behind at that moment
and gets a catch-up queued, which used to sync it again right after the running sync had already
brought it to the same version. Real TrainerApp and RolloutApp on loopback gRPC.
"""

from __future__ import annotations

import threading
import time

import torch

from tests.support.local_apps import local_fleet
from weightsync.v1 import rollout_pb2


def test_catch_up_of_a_rollout_the_running_sync_updated_does_nothing():
    with local_fleet({"r": {}}) as (trainer, rollouts, _):
        rollout = rollouts["r"]
        entry = trainer.registry.get("r")
        orch = trainer.orch
        assert orch.sync([entry], only_behind=True).ok  # behind (version 0): synced
        assert orch.sync([entry], only_behind=True) is None  # current: nothing to do
        syncs = rollout.metrics.registry.get_sample_value(
            "weightsync_syncs_total", {"role": "rollout", "outcome": "committed"}
        )

        # a catch-up decided while a sync holds the lock, as a heartbeat during a sync does
        with torch.no_grad():
            next(trainer.actor.model.parameters()).add_(1.0)
        trainer.actor.version += 1
        orch.actor_lock.acquire()  # a sync is running
        try:
            catch_up: list = []
            waiter = threading.Thread(target=lambda: catch_up.append(orch.sync([entry], wait_s=30, only_behind=True)))
            waiter.start()  # queued behind it, decided while the rollout was still behind
            report = orch._sync_locked([entry], "tcp", 30.0)  # the running sync brings the rollout up to date
        finally:
            orch.actor_lock.release()
        waiter.join(30)
        assert report.ok and catch_up == [None]
        after = rollout.metrics.registry.get_sample_value(
            "weightsync_syncs_total", {"role": "rollout", "outcome": "committed"}
        )
        assert after == syncs + 1 and rollout.tx.version == trainer.actor.version
        assert rollout.tx.state == rollout_pb2.SERVING


def _bump(trainer) -> int:
    """A new trainer version, as a train step or a LoadWeights makes one, synced to nobody yet."""
    with torch.no_grad():
        next(trainer.actor.model.parameters()).add_(1.0)
    trainer.actor.version += 1
    return trainer.actor.version


def _register(stub, rid, app):
    from weightsync.v1 import trainer_pb2

    return stub.RegisterRollout(trainer_pb2.RegisterRolloutRequest(rollout_id=rid, address=app.grpc.address))


def test_a_heartbeat_between_a_weight_update_and_its_sync_starts_no_catch_up_one_that_missed_a_sync_does():
    with local_fleet({"a": {}, "b": {}}) as (trainer, rollouts, stub):
        trainer.servicer.auto_sync = True
        orch = trainer.orch
        first = orch.sync(trainer.registry.all())
        assert first.ok and orch.fleet_version == first.version

        # the trainer moves on; both rollouts are on the fleet's version: their heartbeats queue nothing
        # (the caller's own sync comes next and would find the lock taken by a catch-up)
        v2 = _bump(trainer)
        for rid, app in rollouts.items():
            resp = _register(stub, rid, app)
            assert not resp.sync_scheduled and not resp.current, (rid, resp)
        assert trainer.servicer._catchup.empty()

        # b alone gets v2: a missed the fleet's latest sync, so its next heartbeat catches it up to v2
        assert orch.sync([trainer.registry.get("b")]).ok and orch.fleet_version == v2
        assert _register(stub, "a", rollouts["a"]).sync_scheduled
        deadline = time.monotonic() + 30
        while rollouts["a"].tx.version != v2:
            assert time.monotonic() < deadline, "a was not caught up to the fleet's version"
            time.sleep(0.02)
        assert torch.equal(*(next(r.engine.model.parameters()) for r in rollouts.values()))  # the same v2


def test_a_stale_rollout_on_the_fleet_version_is_caught_up():
    with local_fleet({"r": {}}) as (trainer, _, _stub):
        orch = trainer.orch
        entry = trainer.registry.get("r")
        assert orch.sync([entry]).ok
        _bump(trainer)
        trainer.registry.poll(entry)
        assert not orch.needs_catch_up(entry)  # on the fleet's version, behind only the unsynced update
        entry.state = rollout_pb2.STALE  # what a failed in-place apply leaves; refuses generation
        assert orch.needs_catch_up(entry)


def test_a_rollout_whose_memory_is_released_is_not_caught_up_the_next_fleet_sync_maps_it_back():
    """Colocated RL: a rollout released its GPU memory for the trainer's step. Behind or not, its heartbeat
    queues no catch-up (one would take the sync lock between the release and the step and map the rollout's
    memory back under the trainer), a catch-up queued earlier finds nothing to do; the driver's sync of the
    whole fleet after the step brings it to the trainer's weights and serving again."""
    with local_fleet({"a": {}, "b": {}}) as (trainer, rollouts, stub):
        trainer.servicer.auto_sync = True
        orch = trainer.orch
        assert orch.sync(trainer.registry.all()).ok
        v2 = _bump(trainer)
        assert orch.sync([trainer.registry.get("b")]).ok and orch.fleet_version == v2  # a missed v2: behind
        a = rollouts["a"]
        a.tx.memory_released = True  # as ReleaseMemory leaves it (the built-in engine has nothing to free)
        resp = _register(stub, "a", a)
        entry = trainer.registry.get("a")
        assert entry.memory_released and entry.version < v2
        assert not resp.sync_scheduled and trainer.servicer._catchup.empty()
        assert orch.sync([entry], only_behind=True) is None  # a catch-up queued before the release
        assert a.tx.version < v2 and a.tx.memory_released

        v3 = _bump(trainer)  # the train step
        report = orch.sync(trainer.registry.all())  # the driver's sync after it
        assert report.ok and {r.rollout_id for r in report.rollouts} == {"a", "b"}
        assert a.tx.version == v3 and not a.tx.memory_released and a.tx.state == rollout_pb2.SERVING
        trainer.registry.poll(entry)
        assert not entry.memory_released and not orch.needs_catch_up(entry)
        want, held = dict(trainer.actor.export_tensors()), a.engine.model.state_dict()
        assert set(want) <= set(held)
        for name, t in want.items():
            assert torch.equal(held[name], t.to(held[name].dtype)), name
