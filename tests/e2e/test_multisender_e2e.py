"""Multi-sender streaming through the real services: a torchrun megatron trainer (gloo) whose
pipeline stages (and expert-parallel leaders) each stream their own buckets to two rollouts over
TCP. Each rollout's data port sits behind a BusProxy (tests.support.bus_proxy), which sees which trainer
rank sends on each connection and can cut one sender's link or fire a hook mid-stream.
"""

from __future__ import annotations

import glob
import os
import signal
import threading
from pathlib import Path

import grpc
import pytest
import torch
from reliability_helpers import MODEL_KW, rstub, score, status, sync_rpc, tstub, wait_for
from safetensors.torch import load_file

from tests.support.bus_proxy import BusProxy, SenderLinks
from weightsync.local.procs import free_port, wait_registered, wsctl
from weightsync.v1 import rollout_pb2, trainer_pb2

PROMPT = [5, 17, 42, 7, 99, 3]
# a torchrun trainer (2 or 4 ranks) and two rollouts per test: 35-75 s each on 2 shared cores
pytestmark = pytest.mark.slow


def _fleet(procs, model: str, nproc: int, *trainer_args: str, rate: float | None = None):
    """A torchrun trainer and two rollouts whose data ports sit behind per-sender link proxies."""
    links = SenderLinks(rate)
    trainer = procs.trainer(
        "--model", model, "--pp", "2", "--bucket-mb", "1", "--no-auto-sync-new-rollouts", *trainer_args, nproc=nproc
    )
    rollouts, proxies = [], []
    for i in range(2):
        dport = free_port()
        # the rollout listens on 127.0.0.1 and advertises 127.0.0.(2+i), where its proxy listens
        proxies.append(BusProxy(f"127.0.0.{2 + i}", dport, ("127.0.0.1", dport), links))
        rollouts.append(
            procs.rollout(
                "--model",
                model,
                "--init-seed",
                str(10 + i),
                "--trainer-address",
                trainer.address,
                "--data-address",
                f"127.0.0.1:{dport}",
                "--advertise-data-host",
                f"127.0.0.{2 + i}",
                name=f"r{i}",
            )
        )
    trainer.wait_ready(240)
    for r in rollouts:
        r.wait_ready()
    wait_registered(trainer.address, ["r0", "r1"])
    return trainer, rollouts, proxies, links


def _exported(trainer, out: Path) -> dict[str, torch.Tensor]:
    # the RPC wsctl's export makes (a wsctl process would add a Python start-up per export)
    tstub(trainer).ExportHf(trainer_pb2.ExportHfRequest(out_dir=str(out)))
    sd = {}
    for f in glob.glob(str(out / "*.safetensors")):
        sd.update(load_file(f))
    return sd


def _hf_logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    torch.set_num_threads(1)  # as the rollout process runs: same reduction order, exact equality
    with torch.no_grad():
        return m(torch.tensor([PROMPT])).logits[0, -1].float()


def _bytes(sd: dict[str, torch.Tensor], pred) -> int:
    return sum(t.numel() * t.element_size() for n, t in sd.items() if pred(n))


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def _senders(report) -> dict[int, trainer_pb2.SenderReport]:
    return {s.rank: s for s in report.senders}


def test_pp2_every_stage_streams_its_own_layers_and_one_failing_sender_aborts_everywhere(procs):
    trainer, rollouts, proxies, links = _fleet(procs, "tiny-qwen2", 2)
    try:
        before = [score(rstub(r), PROMPT) for r in rollouts]
        rep = sync_rpc(trainer.address)
        assert rep.ok, rep
        sd = _exported(trainer, procs.tmp / "exported")
        # stage 0 holds the embedding and layer 0, stage 1 layer 1, the final norm and the head
        stage0 = _bytes(sd, lambda n: n.startswith("model.embed_tokens.") or _layer(n) == 0)
        stage1 = _bytes(sd, lambda n: not (n.startswith("model.embed_tokens.") or _layer(n) == 0))
        assert stage0 > 0 and stage1 > 0
        s = _senders(rep)
        assert sorted(s) == [0, 1], rep.senders
        assert (s[0].bytes, s[1].bytes) == (stage0, stage1)
        assert s[0].forwarded_bytes == 0 and s[1].forwarded_bytes == 0  # nothing crossed to rank 0
        # each stage (TP=EP=1) wrote its buckets straight from its own parameters and sent them in
        # place (MegatronActor.own_flat_buckets): no export pass, no pack buffers
        assert all(x.flat_buckets == x.num_buckets > 0 and x.peak_buffer_bytes == 0 for x in s.values()), rep.senders
        assert trainer.metric("weightsync_sync_sender_bytes_total", 'rank="0",role="trainer"') == stage0
        assert trainer.metric("weightsync_sync_sender_bytes_total", 'rank="1",role="trainer"') == stage1
        assert trainer.metric("weightsync_sync_forwarded_bytes_total", 'rank="0",role="trainer"') == 0
        # every rollout took one connection per sender, and each sender moved its bytes to both
        assert all(sorted(p.connections) == [0, 1] for p in proxies), [p.connections for p in proxies]
        assert links.sent[1] >= 2 * stage1 and links.sent[0] >= 2 * stage0
        want = _hf_logits(procs.tmp / "exported")
        for r in rollouts:
            logits, version = score(rstub(r), PROMPT)
            assert version == rep.version and torch.equal(logits, want), (logits - want).abs().max()
        # synced again (sync_encoding auto): every stage diffs its own layers against what it kept
        # of the last stream; nothing changed, so each rollout gets frame headers only, still exact
        again = sync_rpc(trainer.address)
        assert again.ok and all(r.encoding == "delta" for r in again.rollouts), again
        assert all(r.wire_bytes < 4096 for r in again.rollouts), again
        for r in rollouts:
            assert torch.equal(score(rstub(r), PROMPT)[0], want)

        # the funnel, for contrast: rank 0 receives stage 1's tensors and sends everything
        out = wsctl("--address", trainer.address, "sync", "--senders", "rank0")
        assert out.returncode == 0 and "senders (1):" in out.stdout and "MB forwarded to it" in out.stdout, out.stdout
        funnel = tstub(trainer).GetStatus(trainer_pb2.TrainerStatusRequest()).last_sync
        assert funnel.ok and [x.rank for x in funnel.senders] == [0]
        assert funnel.senders[0].bytes == stage0 + stage1 and funnel.senders[0].forwarded_bytes == stage1
        # the funnel packs (rank 0 does not hold the whole model): two 1 MiB buckets at most
        assert funnel.senders[0].flat_buckets == 0 and 0 < funnel.senders[0].peak_buffer_bytes <= 2 << 20

        # sender 1's link breaks mid-stream: both rollouts abort and keep serving their version
        served = [score(rstub(r), PROMPT) for r in rollouts]
        links.reset()
        links.cut_after[1] = 40_000
        bad = sync_rpc(trainer.address)
        # rank 1 may have handed all its bytes to the kernel before the cut: then the failure shows
        # at commit, where each rollout has already aborted the sync it could not complete
        assert not bad.ok and not any(r.ok for r in bad.rollouts), bad
        for r, (logits, version) in zip(rollouts, served):
            st = status(rstub(r))
            assert st.state == rollout_pb2.SERVING and st.pending_sync_id == "" and st.version == version
            assert "aborted (receive failed" in st.last_error, st.last_error
            now, v = score(rstub(r), PROMPT)
            assert v == version and torch.equal(now, logits)
        # and the next sync goes through
        links.reset()
        after = sync_rpc(trainer.address)
        assert after.ok
        # the stages still send in place after the funnel and a failed sync (their plans are kept)
        assert all(x.flat_buckets == x.num_buckets for x in after.senders), after.senders
        assert not torch.equal(before[0][0], score(rstub(rollouts[0]), PROMPT)[0])
    finally:
        for p in proxies:
            p.close()


def test_pp2_fp8_every_stage_quantizes_and_streams_its_own_layers(procs):
    """export_dtype fp8-block with senders=all: each stage quantizes the weights it assembles and
    streams them with their scales; the rollouts serve exactly what the rank-0 funnel gives."""
    trainer, rollouts, proxies, links = _fleet(procs, "tiny-qwen2", 2, "--export-dtype", "fp8-block")
    try:
        rep = sync_rpc(trainer.address)
        assert rep.ok, rep
        from rollout_svc.engine.builtin import BuiltinEngine
        from weightsync.models import resolve_model

        plain = len(BuiltinEngine.from_config(resolve_model("tiny-qwen2")[0], seed=0).param_metas())
        assert rep.num_tensors > plain  # weights travel with their *_scale_inv
        s = _senders(rep)
        assert sorted(s) == [0, 1] and s[0].forwarded_bytes == 0 and s[1].forwarded_bytes == 0, rep.senders
        assert all(x.flat_buckets == 0 for x in s.values()), rep.senders  # a quantized format packs
        assert all(sorted(p.connections) == [0, 1] for p in proxies), [p.connections for p in proxies]
        multi = [score(rstub(r), PROMPT) for r in rollouts]
        assert all(v == rep.version for _, v in multi)
        out = wsctl("--address", trainer.address, "sync", "--senders", "rank0")
        assert out.returncode == 0 and "senders (1):" in out.stdout, out.stdout
        funnel = tstub(trainer).GetStatus(trainer_pb2.TrainerStatusRequest()).last_sync
        assert funnel.ok and funnel.senders[0].bytes == s[0].bytes + s[1].bytes, (funnel.senders, rep.senders)
        for r, (logits, _) in zip(rollouts, multi):
            again, _ = score(rstub(r), PROMPT)
            assert torch.equal(again, logits)
    finally:
        for p in proxies:
            p.close()


def _rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of the torchrun child running global rank `rank`."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == torchrun_pid and f"RANK={rank}".encode() in env:
            return int(d.name)
    raise LookupError(f"no rank {rank} under torchrun pid {torchrun_pid}")


def test_a_sender_killed_mid_stream_aborts_the_sync_on_every_rollout(procs):
    # 34 MB (17 MB per stage and connection, more than the socket buffers on the way hold), paced
    # at 5 MB/s per sender: rank 1 is killed after its first MB, with most of its layers unsent
    from transformers import Qwen2Config

    model = procs.tmp / "model"
    Qwen2Config(**MODEL_KW).save_pretrained(str(model))
    # full: the second sync streams the same version again, which as deltas would be headers only
    trainer, rollouts, proxies, links = _fleet(procs, str(model), 2, "--sync-encoding", "full", rate=5e6)
    try:
        # first a complete multi-sender sync (unpaced): the version the rollouts must keep serving
        initial = [score(rstub(r), PROMPT) for r in rollouts]
        links.reset(None)
        first = sync_rpc(trainer.address)
        assert first.ok and sorted(s.rank for s in first.senders) == [0, 1], first
        served = [score(rstub(r), PROMPT) for r in rollouts]
        assert all(v == first.version and not torch.equal(a, b) for (a, _), (b, v) in zip(initial, served))
        links.reset(5e6)
        victim = _rank_pid(trainer.popen.pid, 1)
        links.hooks.append((1, 1_000_000, lambda: os.kill(victim, signal.SIGKILL)))
        errors = []

        def sync():
            try:
                tstub(trainer, timeout=60).Sync(trainer_pb2.SyncRequest())
            except grpc.RpcError as exc:  # the whole torchrun job goes down with its rank
                errors.append(exc.code())

        t = threading.Thread(target=sync)
        t.start()
        for r in rollouts:  # every rollout prepared the sync, then dropped it
            wait_for(lambda r=r: "aborted" in status(rstub(r)).last_error, 60, f"{r.name} aborted")
        t.join(90)
        assert all("prepared sync" in r.log() for r in rollouts)
        # rank 1 died having moved well under the 2 x 17 MB it owes the two rollouts
        assert links.sent.get(1, 0) < 20e6, links.sent
        for r, (logits, version) in zip(rollouts, served):
            st = status(rstub(r))
            assert st.state == rollout_pb2.SERVING and st.version == version == first.version, st
            assert "aborted" in st.last_error, st.last_error
            now, v = score(rstub(r), PROMPT)
            assert v == version and torch.equal(now, logits)
    finally:
        for p in proxies:
            p.close()


def test_moe_pp2_ep2_every_stage_and_expert_leader_streams_its_own(procs):
    trainer, rollouts, proxies, links = _fleet(procs, "tiny-qwen3-moe", 4, "--ep", "2")
    try:
        rep = sync_rpc(trainer.address)
        assert rep.ok, rep
        sd = _exported(trainer, procs.tmp / "exported")

        # megatron's rank order with TP=1, PP=2, EP=2 on 4 ranks: stage s holds ranks 2s, 2s+1; the
        # dense leader of stage s is rank 2s and EP rank e of stage s is rank 2s+e. 4 experts: EP
        # rank e holds experts 2e, 2e+1 of each of its stage's layers.
        def owner(n: str) -> int:
            layer = _layer(n)
            stage = 0 if n.startswith("model.embed_tokens.") else 1 if layer is None else layer
            if ".mlp.experts." in n:
                return 2 * stage + int(n.split(".")[5]) // 2
            return 2 * stage

        want = {rank: _bytes(sd, lambda n, rank=rank: owner(n) == rank) for rank in range(4)}
        got = {s.rank: s.bytes for s in rep.senders}
        assert got == want, (got, want)
        assert all(s.forwarded_bytes == 0 and not s.error for s in rep.senders)
        # TP = expert-TP = 1: every rank (each stage's dense leader, and the second EP rank with its
        # experts alone) wrote its buckets straight from its own parameters and sent them in place
        # (MegatronActor.own_flat_buckets): no export pass, no pack buffers
        assert all(s.flat_buckets == s.num_buckets > 0 and s.peak_buffer_bytes == 0 for s in rep.senders), rep.senders
        ref = _hf_logits(procs.tmp / "exported")
        for r in rollouts:
            logits, version = score(rstub(r), PROMPT)
            assert version == rep.version and torch.equal(logits, ref), (logits - ref).abs().max()
    finally:
        for p in proxies:
            p.close()


def test_tp2_pp2_each_stage_leader_streams_its_flat_buckets_with_its_tp_groups_shards(procs):
    """TP=2 x PP=2 on 4 ranks: the two stage leaders (ranks 0 and 2) send; each writes its buckets
    from its own shards and the ones its TP rank sends it (flat_export.py at TP > 1, tp_gather.py),
    and streams them in place: no export pass, no pack buffers; the rollouts serve the exported model
    exactly, again after a second (delta) sync."""
    trainer, rollouts, proxies, links = _fleet(procs, "tiny-qwen2", 4, "--tp", "2")
    try:
        rep = sync_rpc(trainer.address)
        assert rep.ok, rep
        s = _senders(rep)
        assert sorted(s) == [0, 2], rep.senders
        assert all(x.flat_buckets == x.num_buckets > 0 and x.peak_buffer_bytes == 0 for x in s.values()), rep.senders
        assert all(x.forwarded_bytes == 0 and not x.error for x in s.values()), rep.senders
        sd = _exported(trainer, procs.tmp / "exported")
        stage0 = _bytes(sd, lambda n: n.startswith("model.embed_tokens.") or _layer(n) == 0)
        assert (s[0].bytes, s[2].bytes) == (stage0, _bytes(sd, lambda n: True) - stage0)
        want = _hf_logits(procs.tmp / "exported")
        for r in rollouts:
            logits, version = score(rstub(r), PROMPT)
            assert version == rep.version and torch.equal(logits, want), (logits - want).abs().max()
        again = sync_rpc(trainer.address)
        assert again.ok and all(x.flat_buckets == x.num_buckets for x in again.senders), again.senders
        for r in rollouts:
            assert torch.equal(score(rstub(r), PROMPT)[0], want)
    finally:
        for p in proxies:
            p.close()
