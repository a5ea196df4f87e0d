"""Multi-sender streaming with the trainer's ranks on GPUs: a torchrun megatron trainer with PP=2
(rank r on cuda:r) streams each stage's buckets from its own GPU over TCP to two rollouts (one per
GPU). Run on a host with >= 2 GPUs: pytest -m gpu tests/gpu/test_multisender_gpu.py.

Exactness as in test_services_gpu.py: a rollout's logits equal, bit for bit, those of a reference
engine loaded from the trainer's own export on the rollout's GPU. NCCL streams from rank 0 only
(docs/architecture.md): with PP=2 its sync takes the funnel, and asking for senders=all is refused.
"""
from __future__ import annotations

import torch

from test_services_gpu import (NGPU, _assert_exact, _model_dir, _reference_logits, _sync, needs_gpus,  # noqa: F401
                               fleet)
from weightsync.local.procs import start_trainer, wait_registered, wsctl

import pytest

pytestmark = pytest.mark.gpu


@needs_gpus(2)
def test_pp2_every_stage_streams_from_its_own_gpu_exactly_and_nccl_takes_the_funnel(fleet):
    t = start_trainer(fleet.tmp, "--backend", "megatron", "--model", str(_model_dir(fleet.tmp)), "--pp", "2",
                      "--bucket-mb", "4", "--no-auto-sync-new-rollouts", "--init-seed", "1", nproc=2)
    try:
        t.wait_ready(300)
        rs = [fleet.rollout(f"r{i}", "--device", f"cuda:{i}", trainer_proc=t) for i in range(2)]
        for r in rs:
            r.wait_ready()
        wait_registered(t.address, ["r0", "r1"])

        rc, rep = _sync(t)
        assert rc == 0 and rep["ok"] and rep["transport"] == "tcp", rep
        senders = {int(s["rank"]): s for s in rep["senders"]}
        assert sorted(senders) == [0, 1], rep["senders"]
        assert all(int(s.get("forwarded_bytes", 0)) == 0 for s in senders.values())
        assert sum(int(s["bytes"]) for s in senders.values()) <= int(rep["bytes"])
        version = int(rep["version"])
        for i, r in enumerate(rs):
            _assert_exact(r, _reference_logits(t, fleet.tmp, f"all-{i}", f"cuda:{i}", torch.float32), version)
        print(f"multi-sender: {rep['seconds']:.3f}s, senders "
              + ", ".join(f"rank {k} {int(s['bytes']) / 1e6:.1f} MB {s['seconds']:.3f}s" for k, s in senders.items()))

        rc, funnel = _sync(t, "--senders", "rank0")
        assert rc == 0 and funnel["ok"] and [int(s["rank"]) for s in funnel["senders"]] == [0], funnel
        assert int(funnel["senders"][0]["forwarded_bytes"]) == int(senders[1]["bytes"])
        print(f"funnel: {funnel['seconds']:.3f}s")

        # NCCL: explicit senders=all is refused; the configured default falls back to the funnel
        refused = wsctl("--address", t.address, "sync", "--transport", "nccl", "--senders", "all", "--rollout", "r1")
        assert refused.returncode != 0 and "senders=all streams over tcp only" in refused.stdout + refused.stderr
        rc, rep = _sync(t, "--transport", "nccl", "--rollout", "r1")
        assert rc == 0 and rep["ok"] and [int(s["rank"]) for s in rep["senders"]] == [0], rep
        _assert_exact(rs[1], _reference_logits(t, fleet.tmp, "nccl", "cuda:1", torch.float32), int(rep["version"]))
    finally:
        t.stop()
