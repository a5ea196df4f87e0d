"""Multi-sender NCCL through the real services and processes: a torchrun megatron trainer (gloo)
with PP=2 whose two stages each broadcast their own buckets on their own group to two rollout
processes. CI has no GPU, so libnccl is replaced in every process by a gloo stand-in with the
same interface (tests.support.gloo_nccl, selected by the services' debug.nccl_bus); what runs is ours:
rank 0 planning a group per sender, the SendJob carrying each rank its group, every rank building
and keeping its communicator, each rollout joining both groups and committing once both senders'
buckets have arrived. The same paths on real NCCL: tests/gpu/test_multisender_gpu.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path

import grpc
import pytest
import torch
from reliability_helpers import MODEL_KW, rstub, score, status, tstub, wait_for
from test_multisender_e2e import PROMPT, _bytes, _exported, _hf_logits, _layer, _rank_pid, _senders

from weightsync.local.procs import wait_registered, wsctl
from weightsync.v1 import rollout_pb2, trainer_pb2

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gloo_nccl(monkeypatch):
    """Every service process started by the test builds its NCCL groups over the gloo stand-in,
    which it imports from the repository root (tests.support is not part of the product)."""
    for service in ("TRAINER", "ROLLOUT"):  # the services' debug.nccl_bus, by their env prefixes
        monkeypatch.setenv(f"WS_{service}_NCCL_BUS", "tests.support.gloo_nccl:GlooNcclBus")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


def _fleet(procs, model: str, *trainer_args: str):
    trainer = procs.trainer(
        "--model",
        model,
        "--pp",
        "2",
        "--bucket-mb",
        "1",
        "--no-auto-sync-new-rollouts",
        "--nccl-init-timeout-s",
        "60",
        *trainer_args,
        nproc=2,
    )
    rollouts = [
        procs.rollout("--model", model, "--init-seed", str(10 + i), "--trainer-address", trainer.address, name=f"r{i}")
        for i in range(2)
    ]
    trainer.wait_ready(240)
    for r in rollouts:
        r.wait_ready()
    wait_registered(trainer.address, ["r0", "r1"])
    return trainer, rollouts


def _changed_copy(exported: Path, out: Path, sd: dict[str, torch.Tensor]) -> Path:
    """The exported checkpoint with 2 % of its values changed (what an optimizer step changes of bf16 weights)."""
    from safetensors.torch import save_file

    out.mkdir()
    for f in exported.glob("*.json"):
        if not f.name.endswith(".index.json"):  # the tensors go into one file below
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(5)
    changed = {}
    for name, t in sd.items():
        t = t.clone()
        mask = torch.rand(t.shape, generator=g) < 0.02
        t[mask] = t[mask] * 1.5 + 0.01
        changed[name] = t
    save_file(changed, str(out / "model.safetensors"))
    return out


def _sync(trainer, timeout: float = 120.0, **kw) -> trainer_pb2.SyncReport:
    return tstub(trainer, timeout=timeout).Sync(trainer_pb2.SyncRequest(transport="nccl", **kw)).report


def test_pp2_each_stage_broadcasts_its_own_layers_on_its_own_group_and_keeps_it(procs, gloo_nccl):
    # sync_encoding=delta (auto on nccl waits for a sync to measure a slow link): every stage also keeps its
    # own buckets as its part of the base
    trainer, rollouts = _fleet(procs, "tiny-qwen2", "--sync-encoding", "delta")
    rep = _sync(trainer, senders="all")
    assert rep.ok, rep
    sd = _exported(trainer, procs.tmp / "exported")
    stage0 = _bytes(sd, lambda n: n.startswith("model.embed_tokens.") or _layer(n) == 0)
    stage1 = _bytes(sd, lambda n: not (n.startswith("model.embed_tokens.") or _layer(n) == 0))
    s = _senders(rep)
    assert sorted(s) == [0, 1] and (s[0].bytes, s[1].bytes) == (stage0, stage1), rep.senders
    assert s[0].forwarded_bytes == 0 and s[1].forwarded_bytes == 0  # nothing crossed to rank 0
    # each stage (TP=EP=1) broadcasts its buckets from its own parameters' storage: no pack buffers
    assert all(x.flat_buckets == x.num_buckets > 0 and x.peak_buffer_bytes == 0 for x in s.values()), rep.senders
    want = _hf_logits(procs.tmp / "exported")
    for r in rollouts:
        logits, version = score(rstub(r), PROMPT)
        assert version == rep.version and torch.equal(logits, want), (logits - want).abs().max()
        assert "joined NCCL group" in r.log() and "(sender rank 1)" in r.log()
    assert "NCCL sender group" in trainer.log()
    builds = trainer.metric("weightsync_nccl_group_builds_total", 'role="trainer"')

    # the next sync reuses both groups: no rank or rollout builds a communicator again
    joins = [r.log().count("joined NCCL group") for r in rollouts]
    again = _sync(trainer, senders="all")
    assert again.ok and again.version == rep.version
    assert [r.log().count("joined NCCL group") for r in rollouts] == joins == [2, 2]
    assert trainer.metric("weightsync_nccl_group_builds_total", 'role="trainer"') == builds
    # that sync was offered the base the stages kept; the rollouts held none yet, so every stage framed
    # its buckets dense, and the rollouts kept them. Now both hold it: each stage sends its buckets as
    # deltas on its own group (nothing changed: frame headers only), and the rollouts end exact
    assert [r.encoding for r in again.rollouts] == ["full", "full"], again.rollouts
    assert all(r.wire_bytes > stage0 + stage1 for r in again.rollouts), again.rollouts
    delta = _sync(trainer, senders="all")
    assert delta.ok and sorted(x.rank for x in delta.senders) == [0, 1], delta
    assert [r.encoding for r in delta.rollouts] == ["delta", "delta"], delta.rollouts
    assert all(r.wire_bytes < 4096 for r in delta.rollouts), delta.rollouts
    for r in rollouts:
        logits, version = score(rstub(r), PROMPT)
        assert version == rep.version and torch.equal(logits, want), (logits - want).abs().max()
    assert [r.log().count("joined NCCL group") for r in rollouts] == [2, 2]
    # a new version that changes 2 % of the values: each stage's deltas carry a few percent of its bytes
    changed = _changed_copy(procs.tmp / "exported", procs.tmp / "changed", sd)
    assert wsctl("--address", trainer.address, "load", str(changed)).returncode == 0
    delta = _sync(trainer, senders="all")
    assert delta.ok and delta.version > rep.version, delta
    assert [r.encoding for r in delta.rollouts] == ["delta", "delta"], delta.rollouts
    assert all(r.wire_bytes < 0.15 * (stage0 + stage1) for r in delta.rollouts), (delta.rollouts, stage0 + stage1)
    want = _hf_logits(changed)
    for r in rollouts:
        logits, version = score(rstub(r), PROMPT)
        assert version == delta.version and torch.equal(logits, want), (logits - want).abs().max()

    # the funnel over nccl, for contrast: one group of rank 0, stage 1's tensors forwarded to it
    funnel = _sync(trainer, senders="rank0")
    assert funnel.ok and [x.rank for x in funnel.senders] == [0], funnel
    assert funnel.senders[0].bytes == stage0 + stage1 and funnel.senders[0].forwarded_bytes == stage1

    # a pipelined training step moves the weights the stages send in place (AdamW writes the parameters,
    # which live in the buckets since the first sync): the next sync carries the trained weights exactly
    step = tstub(trainer, timeout=120).TrainStep(
        trainer_pb2.TrainStepRequest(
            samples=[
                trainer_pb2.TrainSample(prompt_ids=PROMPT, response_ids=[8, 16, 5, 7], reward=float(i % 2), group_id=0)
                for i in range(4)
            ]
        )
    )
    assert step.version == delta.version + 1, step
    trained = _sync(trainer, senders="all")
    assert trained.ok and trained.version == step.version, trained
    assert all(x.flat_buckets == x.num_buckets > 0 for x in trained.senders), trained.senders
    _exported(trainer, procs.tmp / "trained")
    before_step, want = want, _hf_logits(procs.tmp / "trained")
    assert not torch.equal(want, before_step)  # the step changed the model
    for r in rollouts:
        logits, version = score(rstub(r), PROMPT)
        assert version == step.version and torch.equal(logits, want), (logits - want).abs().max()
    assert funnel.senders[0].flat_buckets == 0 and 0 < funnel.senders[0].peak_buffer_bytes <= 2 << 20


def test_a_sender_killed_mid_stream_aborts_the_nccl_sync_on_every_rollout(procs, gloo_nccl, monkeypatch):
    from transformers import Qwen2Config

    model = procs.tmp / "model"
    Qwen2Config(**MODEL_KW).save_pretrained(str(model))
    hold = procs.tmp / "hold-rank1"
    monkeypatch.setenv("WS_GLOO_HOLD", str(hold))
    monkeypatch.setenv("WS_GLOO_HOLD_RANK", "1")
    trainer, rollouts = _fleet(procs, str(model))
    first = _sync(trainer, senders="all")
    assert first.ok and sorted(x.rank for x in first.senders) == [0, 1], first
    served = [score(rstub(r), PROMPT) for r in rollouts]
    # rank 1 is held before its first bucket of the next sync and dies there (its buckets never come):
    # held, not raced, so a fast stream cannot finish before the kill
    hold.touch()
    victim = _rank_pid(trainer.popen.pid, 1)
    errors = []

    def sync():
        try:
            _sync(trainer, timeout=90, senders="all")
        except grpc.RpcError as exc:  # the whole torchrun job goes down with its rank
            errors.append(exc.code())

    t = threading.Thread(target=sync)
    t.start()
    wait_for(lambda: all(status(rstub(r)).pending_sync_id for r in rollouts), 60, "the sync prepared")
    wait_for(lambda: Path(f"{hold}.held").exists(), 60, "rank 1 held mid-stream")
    os.kill(victim, signal.SIGKILL)
    for r in rollouts:
        wait_for(lambda r=r: "aborted" in status(rstub(r)).last_error, 90, f"{r.name} aborted")
    t.join(120)
    for r, (logits, version) in zip(rollouts, served):
        st = status(rstub(r))
        assert st.state == rollout_pb2.SERVING and st.version == version == first.version, st
        now, v = score(rstub(r), PROMPT)
        assert v == version and torch.equal(now, logits)
