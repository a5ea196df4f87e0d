"""The first sync of a pairing streams for longer than the liveness timeout and is not taken for silence.

A rollout names its sync link in its first PrepareSync answer (that call went over gRPC). The link
used to be opened only by the next call, the commit, so during the first stream the watch
(weightsync.publisher.stream_liveness) pinged a link with no socket, heard nothing, and dropped a healthy
rollout as "silent mid-stream" once the stream outlasted liveness_timeout_s: the first full sync of a
large model over a slow link. Here a real TrainerApp and RolloutApp on loopback, the rollout's bus
port behind tests.support.bus_proxy paced so that the very first stream lasts several liveness
timeouts: the sync commits, and its commit already goes over the link opened after the prepare.
"""

from __future__ import annotations

import torch

from tests.support.bus_proxy import BusProxy
from tests.support.local_apps import start_rollout, start_trainer
from tests.support.paced_model import paced_model
from weightsync.control.client import channel, trainer_stub
from weightsync.local.procs import free_port
from weightsync.v1 import trainer_pb2

TOKEN = "first-stream-s3cret"
LIVENESS_S = 1.0
#: the paced first stream's length: several liveness timeouts
STREAM_S = 3.0


def _calls(trainer, method: str, path: str) -> float:
    return trainer.orch.metrics.calls.labels("trainer", method, path)._value.get()


def test_the_first_stream_outlasting_the_liveness_timeout_commits_and_its_commit_takes_the_link(tmp_path):
    model = paced_model(tmp_path)  # the pace holds the stream
    trainer = start_trainer(
        model=model, sync_timeout_s=60.0, auth_token=TOKEN, liveness_timeout_s=LIVENESS_S, sync_encoding="full"
    )
    dport = free_port()
    proxy = BusProxy("127.0.0.2", dport, ("127.0.0.1", dport))
    rollout = start_rollout(
        "r", model=model, auth_token=TOKEN, data_address=f"127.0.0.1:{dport}", advertise_data_host="127.0.0.2"
    )
    try:
        stub = trainer_stub(channel(trainer.grpc.address), TOKEN, 60)
        stub.RegisterRollout(trainer_pb2.RegisterRolloutRequest(rollout_id="r", address=rollout.grpc.address))
        total = sum(p.numel() * p.element_size() for p in trainer.actor.model.parameters())
        proxy.set("slow", rate=total / STREAM_S)
        report = stub.Sync(trainer_pb2.SyncRequest()).report
        assert report.ok, report
        assert [(r.rollout_id, r.ok) for r in report.rollouts] == [("r", True)], report
        assert report.seconds >= STREAM_S * 0.8, report.seconds  # the pace held: the stream outlasted it
        assert _calls(trainer, "PrepareSync", "grpc") == 1 and _calls(trainer, "CommitSync", "link") == 1
        for name, t in trainer.actor.export_tensors():
            assert torch.equal(rollout.engine._target(name), t), name
        assert rollout.tx.version == trainer.actor.version
    finally:
        proxy.set("pass")
        rollout.stop()
        proxy.close()
        trainer.stop()
