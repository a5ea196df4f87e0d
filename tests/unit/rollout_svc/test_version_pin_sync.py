"""A real sync that lands while a long Generate runs never changes the weights under it.

Requests interleave between decode steps, so the commit could in principle slip in mid-request;
the version pin makes it wait. In-process trainer (hf backend) and rollout (staged apply), real
gRPC: the long Generate must return exactly what it returns on an idle engine at the old version
(same seed) and report the old version although the sync was issued while it ran (a commit
mid-request would change its tokens: the new weights are visibly different); the next request is
served from the new weights and says so.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.local_apps import local_fleet
from weightsync.control.client import channel, rollout_stub, trainer_stub
from weightsync.v1 import rollout_pb2, trainer_pb2

LONG = rollout_pb2.GenerateRequest(
    prompts=[rollout_pb2.Prompt(token_ids=[4, 5, 6])] * 2,
    sampling=rollout_pb2.SamplingParams(max_new_tokens=300, n=4, seed=5, temperature=1.0),
    return_logprobs=True,
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")  # LoadWeights reads only inside the trainer's data root
    rollout = {"p": {"apply_mode": "staged", "sync_timeout_s": 120}}
    with local_fleet(rollout, sync_timeout_s=120, data_root=str(root)) as (trainer, rollouts, _):
        yield trainer, rollouts["p"], root


def _samples(resp):
    return [(list(s.token_ids), list(s.logprobs)) for s in resp.samples]


def test_sync_waits_for_the_pinned_request(fleet):
    trainer, rollout, tmp_path = fleet
    from trainer_svc.export_hf import save_hf_dir

    with channel(trainer.grpc.address) as tch, channel(rollout.grpc.address) as rch:
        tstub, rstub = trainer_stub(tch, "", 300), rollout_stub(rch, "", 300)
        assert tstub.Sync(trainer_pb2.SyncRequest()).report.ok
        old = rollout.tx.version
        t0 = time.monotonic()
        ref = rstub.Generate(LONG)
        long_s = time.monotonic() - t0
        assert ref.version == old
        # new weights on the trainer (a perturbed copy of its own)
        save_hf_dir(trainer.actor, str(tmp_path))
        f = tmp_path / "model.safetensors"
        save_file({k: v + 0.05 for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
        assert tstub.LoadWeights(trainer_pb2.LoadWeightsRequest(hf_path=str(tmp_path))).version == old + 1

        done = {}

        def long_request():
            done["resp"] = rstub.Generate(LONG)

        t = threading.Thread(target=long_request)
        t.start()
        while rollout.tx.engine_lock.idle:
            time.sleep(0.002)
        time.sleep(min(0.5, long_s / 4))  # well inside the long request
        assert "resp" not in done and rollout.tx.engine_lock.pins == 1, "the long request ended too soon"
        rep = tstub.Sync(trainer_pb2.SyncRequest()).report
        t.join(120)
        assert rep.ok and rep.version == old + 1, rep
        resp = done["resp"]
        # the request ran on the old weights from its first token to its last, and says so
        assert resp.version == old and _samples(resp) == _samples(ref)
        after = rstub.Generate(LONG)
        assert after.version == old + 1 == rollout.tx.version
        assert _samples(after) != _samples(ref)  # new weights, visibly
        assert torch.isfinite(torch.tensor([lp for s in after.samples for lp in s.logprobs])).all()
