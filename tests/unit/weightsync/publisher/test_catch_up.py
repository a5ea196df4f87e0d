"""A catch-up sync queued while another sync runs is re-checked once it holds the sync lock.

Rollouts re-register every heartbeat; one that registers during a sync is behind at that moment
and gets a catch-up queued, which used to sync it again right after the running sync had already
brought it to the same version. Real TrainerApp and RolloutApp on loopback gRPC.
"""

from __future__ import annotations

import threading

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
