"""train_step on the megatron-core backend (CPU, gloo): parity with the transformers backend,
loss decreases, checkpoint resume, and TP=2 / PP=2 under torchrun (one launch) equal to TP=1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.train_requests import make_request
from trainer_svc.config import OptimConfig
from trainer_svc.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer_svc.train.step import compute_logprobs, train_state, train_step

pytest.importorskip("megatron.core")
SUPPORT = Path(__file__).resolve().parents[3] / "support"


def _actor(seed=1, **settings):
    from trainer_svc.actor.megatron.actor import MegatronActor
    from weightsync.models import resolve_model

    a = MegatronActor.create(resolve_model("tiny-qwen2")[0], seed=seed)
    train_state(a, OptimConfig(**{"lr": 1e-3, **settings}))
    return a


def _with_logprobs(actor, req):
    for s, row in zip(req.samples, compute_logprobs(actor, list(req.samples))):
        s.rollout_logprobs[:] = row
    return req


def test_megatron_step_equals_the_transformers_step_on_the_same_weights(tmp_path, hf_actor_factory):
    from trainer_svc.actor.hf.actor import HfActor
    from trainer_svc.export_hf import save_hf_dir

    m = _actor(grad_clip=0.0)
    save_hf_dir(m, str(tmp_path / "w"))
    h = HfActor(m.config, weights_dir=str(tmp_path / "w"))
    train_state(h, OptimConfig(lr=1e-3, grad_clip=0.0))
    req = _with_logprobs(h, make_request(kl_coef=0.1, entropy_coef=0.01))
    req.micro_batch_size = 5
    rows_m = compute_logprobs(m, list(req.samples), micro_batch_size=3)
    assert max(abs(a - b) for r, s in zip(rows_m, req.samples) for a, b in zip(r, s.rollout_logprobs)) < 1e-5
    for _ in range(2):
        mm, mh = train_step(m, req), train_step(h, req)
        for k in ("loss", "pg_loss", "entropy", "kl", "clip_frac", "grad_norm"):
            assert mm[k] == pytest.approx(mh[k], rel=1e-4, abs=1e-6), k
    save_hf_dir(m, str(tmp_path / "after"))
    from safetensors.torch import load_file

    after = load_file(str(tmp_path / "after" / "model.safetensors"))
    for n, p in h.model.state_dict().items():
        assert torch.allclose(after[n], p, atol=2e-5), n


def test_megatron_loss_decreases_and_checkpoint_resume_is_exact(tmp_path):
    req = make_request(kl_coef=0.05)
    a = _actor()
    _with_logprobs(a, req)
    req.micro_batch_size = 4
    losses = [train_step(a, req)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05 and a.step == 4 and a.version == 5
    save_checkpoint(a, str(tmp_path))
    want = [train_step(a, req)["loss"] for _ in range(2)]
    b = _actor(seed=7)
    load_checkpoint(b, latest_checkpoint(str(tmp_path)))
    assert (b.step, b.version) == (4, 5)
    assert [train_step(b, req)["loss"] for _ in range(2)] == want


# both 2-rank layouts in one torchrun launch (each launch pays megatron's imports in every rank)
LAYOUTS = {"tp2": "2,1", "pp2": "1,2"}


@pytest.mark.slow
def test_parallel_layouts_match_tp1(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = str(SUPPORT / "_mp_worker.py")
    single = subprocess.run(
        [sys.executable, script, str(tmp_path / "tp1.json"), str(tmp_path / "w"), "1,1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    multi = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            script,
            str(tmp_path / "mp.json"),
            str(tmp_path / "w"),
            *LAYOUTS.values(),
        ],
        capture_output=True,
        text=True,
        timeout=300 * len(LAYOUTS),
        env=env,
    )
    assert multi.returncode == 0, multi.stdout[-3000:] + multi.stderr[-3000:]
    a = json.loads((tmp_path / "tp1.json").read_text())["1,1"]
    reports = json.loads((tmp_path / "mp.json").read_text())
    assert sorted(reports) == sorted(LAYOUTS.values())
    for name, layout in LAYOUTS.items():
        b = reports[layout]
        err = max(abs(x - y) for r, s in zip(a["logprobs"], b["logprobs"]) for x, y in zip(r, s))
        assert err < 1e-5, f"{name}: logprobs differ from TP=1 by {err}"
        for sa, sb in zip(a["steps"], b["steps"]):
            for k in ("loss", "entropy", "kl", "grad_norm"):
                assert sa[k] == pytest.approx(sb[k], rel=1e-4, abs=1e-6), (name, k, sa, sb)


def test_save_checkpoint_torch_dist_holds_the_trained_weights(tmp_path):
    """SaveCheckpoint(format=torch_dist) after training: a trainer started from it holds exactly the
    trained weights (the step numbers the directory, as Megatron-LM does)."""
    from trainer_svc.actor.megatron.actor import MegatronActor
    from trainer_svc.actor.megatron.model import named_parameters_global
    from trainer_svc.train import collective
    from weightsync.models import resolve_model

    req = make_request()
    a = _actor()
    _with_logprobs(a, req)
    for _ in range(2):
        train_step(a, req)
    path = collective.run(a, "save_checkpoint", dir=str(tmp_path), format="torch_dist")
    assert path == str(tmp_path / "iter_0000002")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    b = MegatronActor.create(resolve_model("tiny-qwen2")[0], seed=5, megatron_checkpoint=str(tmp_path))
    want, got = named_parameters_global(a.model), named_parameters_global(b.model)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert b.version == 1
    # the same through the trainer's config (--load-megatron-checkpoint) and actor factory
    import argparse

    from trainer_svc.actor.factory import make_actor
    from trainer_svc.config import ENV_PREFIX, TrainerConfig
    from weightsync.config import add_arguments, resolve

    p = argparse.ArgumentParser()
    add_arguments(p, TrainerConfig, ENV_PREFIX)
    cfg = resolve(
        TrainerConfig,
        p.parse_args(
            ["--model", "tiny-qwen2", "--init-seed", "9", "--load-megatron-checkpoint", str(tmp_path / "iter_0000002")]
        ),
        ENV_PREFIX,
        {},
    )
    c = make_actor(cfg)
    got = named_parameters_global(c.model)
    assert all(torch.equal(got[k], want[k]) for k in want)
