"""Multi-sender streaming with the trainer's ranks on GPUs: a torchrun megatron trainer with PP=2
(rank r on cuda:r) streams each stage's buckets from its own GPU over TCP to two rollouts (one per
GPU). Run on a host with >= 2 GPUs:

    OMP_NUM_THREADS=4 python -m pytest -q -s -m gpu tests/gpu/test_multisender_gpu.py

The second test times multi-sender against the rank-0 funnel on a model big enough to measure
(about 0.5 B parameters in fp32 by default; `WS_MS_GPU_LAYERS` / `WS_MS_GPU_HIDDEN` resize it,
`WS_MS_GPU_REPS` sets the syncs of each kind), checks both exactly, and writes its figures as JSON
to `WS_BENCH_OUT` when set.

Exactness as in test_services_gpu.py: a rollout's logits equal, bit for bit, those of a reference
engine loaded from the trainer's own export on the rollout's GPU. Over NCCL each sending rank has a
group of its own with the rollouts; a rollout on a sending rank's GPU cannot join that rank's
group, so on two GPUs the NCCL sync takes the funnel; with four, the last two tests stream each
stage over NCCL from its own GPU to rollouts on the other two, the last with sync_encoding=delta
(each stage's delta frames on its own group; its figures go to `WS_BENCH_OUT`.nccl4_delta.json).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics

import pytest
import torch
from test_services_gpu import (
    _assert_exact,
    _model_dir,
    _reference_logits,
    _sync,
    needs_gpus,
)

from weightsync.local.procs import start_rollout, start_trainer, wait_registered, wsctl

pytestmark = pytest.mark.gpu


@needs_gpus(2)
def test_pp2_every_stage_streams_from_its_own_gpu_exactly_and_nccl_takes_the_funnel(fleet):
    t = start_trainer(
        fleet.tmp,
        "--backend",
        "megatron",
        "--model",
        str(_model_dir(fleet.tmp)),
        "--pp",
        "2",
        "--bucket-mb",
        "4",
        "--no-auto-sync-new-rollouts",
        "--init-seed",
        "1",
        nproc=2,
    )
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
        # over TCP with sync_encoding auto each stage keeps its delta base in host memory, where it
        # packs: its buckets on the GPU would move that copy into GPU memory, so it packs as before
        assert all(int(s.get("flat_buckets", 0)) == 0 for s in senders.values()), senders
        assert sum(int(s["bytes"]) for s in senders.values()) <= int(rep["bytes"])
        version = int(rep["version"])
        for i, r in enumerate(rs):
            _assert_exact(r, _reference_logits(t, fleet.tmp, f"all-{i}", f"cuda:{i}", torch.float32), version)
        print(
            f"multi-sender: {rep['seconds']:.3f}s, senders "
            + ", ".join(f"rank {k} {int(s['bytes']) / 1e6:.1f} MB {s['seconds']:.3f}s" for k, s in senders.items())
        )

        rc, funnel = _sync(t, "--senders", "rank0")
        assert rc == 0 and funnel["ok"] and [int(s["rank"]) for s in funnel["senders"]] == [0], funnel
        assert int(funnel["senders"][0]["forwarded_bytes"]) == int(senders[1]["bytes"])
        print(f"funnel: {funnel['seconds']:.3f}s")

        # NCCL with two GPUs: r1 sits on rank 1's GPU, so it cannot join rank 1's group (one rank
        # per GPU in a group); the sync is retried through rank 0's group at once, and stays there
        rc, rep = _sync(t, "--transport", "nccl", "--senders", "all", "--rollout", "r1")
        assert rc == 0 and rep["ok"] and [int(s["rank"]) for s in rep["senders"]] == [0], rep
        assert "receives on the GPU of trainer rank 1" in t.log()
        _assert_exact(rs[1], _reference_logits(t, fleet.tmp, "nccl", "cuda:1", torch.float32), int(rep["version"]))
        rc, rep = _sync(t, "--transport", "nccl", "--rollout", "r1")
        assert rc == 0 and rep["ok"] and [int(s["rank"]) for s in rep["senders"]] == [0], rep
    finally:
        t.stop()


def _big_model(root):
    """A Qwen2 whose two pipeline halves weigh about the same (untied head), written where
    test_services_gpu._model_dir looks, so the reference engine is built from the same config."""
    from transformers import Qwen2Config

    hidden = int(os.environ.get("WS_MS_GPU_HIDDEN", "2048"))
    cfg = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_attention_heads=16,
        num_key_value_heads=4,
        num_hidden_layers=int(os.environ.get("WS_MS_GPU_LAYERS", "8")),
        vocab_size=32000,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    d = root / "model"
    cfg.save_pretrained(str(d))
    return d


@needs_gpus(2)
def test_pp2_multi_sender_against_the_rank0_funnel_timed_and_exact(tmp_path):
    reps = int(os.environ.get("WS_MS_GPU_REPS", "3"))
    d = _big_model(tmp_path)
    started = []
    try:
        t = start_trainer(
            tmp_path,
            "--backend",
            "megatron",
            "--model",
            str(d),
            "--pp",
            "2",
            "--bucket-mb",
            "64",
            "--no-auto-sync-new-rollouts",
            "--init-seed",
            "1",
            nproc=2,
        )
        started.append(t)
        t.wait_ready(600)
        rs = []
        for i in range(2):
            rs.append(
                start_rollout(
                    tmp_path,
                    "--model",
                    str(d),
                    "--init-seed",
                    "2",
                    "--trainer-address",
                    t.address,
                    "--device",
                    f"cuda:{i}",
                    name=f"r{i}",
                )
            )
            started.append(rs[-1])
        for r in rs:
            r.wait_ready(300)
        wait_registered(t.address, ["r0", "r1"])
        runs = {"all": [], "rank0": []}
        for _ in range(reps):  # alternating, so drift on the host hits both kinds alike
            for kind in ("all", "rank0"):
                rc, rep = _sync(t, "--senders", kind)
                assert rc == 0 and rep["ok"] and rep["transport"] == "tcp", rep
                ranks = sorted(int(s["rank"]) for s in rep["senders"])
                assert ranks == ([0, 1] if kind == "all" else [0]), rep["senders"]
                runs[kind].append(rep)
        # both kinds published the same weights; each rollout serves them exactly
        version = int(runs["all"][-1]["version"])
        for i, r in enumerate(rs):
            _assert_exact(r, _reference_logits(t, tmp_path, f"timed-{i}", f"cuda:{i}", torch.float32), version)
        ms = {int(s["rank"]): s for s in runs["all"][-1]["senders"]}
        assert all(int(s.get("forwarded_bytes", 0)) == 0 for s in ms.values())
        assert int(runs["rank0"][-1]["senders"][0]["forwarded_bytes"]) == int(ms[1]["bytes"])
        med = {k: statistics.median(float(r["seconds"]) for r in v) for k, v in runs.items()}
        stream = {k: statistics.median(float(r["phase_seconds"]["stream"]) for r in v) for k, v in runs.items()}
        out = {
            "bytes_per_rollout": int(runs["all"][-1]["bytes"]),
            "rollouts": 2,
            "reps": reps,
            "median_seconds": med,
            "median_stream_seconds": stream,
            "speedup": med["rank0"] / med["all"],
            "senders_all": [
                {
                    "rank": k,
                    "bytes": int(s["bytes"]),
                    "seconds": float(s["seconds"]),
                    "peak_buffer_bytes": int(s.get("peak_buffer_bytes", 0)),
                    "flat_buckets": int(s.get("flat_buckets", 0)),
                }
                for k, s in sorted(ms.items())
            ],
            "gpus": [torch.cuda.get_device_name(i) for i in range(2)],
            "runs": runs,
        }
        print("multi-sender vs funnel:", json.dumps({k: v for k, v in out.items() if k != "runs"}))
        if os.environ.get("WS_BENCH_OUT"):
            with open(os.environ["WS_BENCH_OUT"], "w") as f:
                json.dump(out, f, indent=1)
    finally:
        for p in started:
            p.stop()
        for p in started:
            print(f"----- {p.name} log (tail) -----\n{p.log()[-2000:]}")


def _pp2_trainer(fleet, *extra: str):
    """A megatron trainer at PP=2 on cuda:0 and cuda:1 over the big test model (64 MB buckets), ready."""
    _big_model(fleet.tmp)
    t = start_trainer(
        fleet.tmp,
        *("--backend", "megatron", "--model", str(_model_dir(fleet.tmp)), "--pp", "2", "--bucket-mb", "64"),
        *("--no-auto-sync-new-rollouts", "--init-seed", "1", *extra),
        nproc=2,
    )
    try:
        t.wait_ready(600)
    except BaseException:
        t.stop()
        raise
    return t


def _two_rollouts(fleet, t) -> list:
    """Rollouts r0 and r1 on cuda:2 and cuda:3, ready and registered with trainer `t`."""
    rs = [fleet.rollout(f"r{i}", "--device", f"cuda:{i + 2}", trainer_proc=t) for i in range(2)]
    for r in rs:
        r.wait_ready()
    wait_registered(t.address, ["r0", "r1"])
    return rs


@needs_gpus(4)
def test_pp2_over_nccl_every_stage_broadcasts_from_its_own_gpu_exactly_and_faster_than_the_funnel(fleet):
    """Trainer PP=2 on cuda:0 and cuda:1, rollouts on cuda:2 and cuda:3: one NCCL group per stage."""
    t = _pp2_trainer(fleet)
    try:
        rs = _two_rollouts(fleet, t)
        reps = int(os.environ.get("WS_MS_GPU_REPS", "3"))
        multi, funnel = [], []
        for _ in range(reps + 1):
            rc, rep = _sync(t, "--transport", "nccl", "--senders", "all")
            assert rc == 0 and rep["ok"] and sorted(int(s["rank"]) for s in rep["senders"]) == [0, 1], rep
            assert all(int(s.get("forwarded_bytes", 0)) == 0 for s in rep["senders"])
            # each stage (TP=EP=1) broadcasts its buckets from its own GPU memory: no export, no pack
            assert all(int(s.get("flat_buckets", 0)) == int(s["num_buckets"]) > 0 for s in rep["senders"]), rep
            multi.append(rep["seconds"])
        for i, r in enumerate(rs):
            _assert_exact(
                r, _reference_logits(t, fleet.tmp, f"nccl-all-{i}", f"cuda:{i + 2}", torch.float32), int(rep["version"])
            )
        for _ in range(reps + 1):
            rc, rep = _sync(t, "--transport", "nccl", "--senders", "rank0")
            assert rc == 0 and rep["ok"] and [int(s["rank"]) for s in rep["senders"]] == [0], rep
            funnel.append(rep["seconds"])
        m, f = statistics.median(multi[1:]), statistics.median(funnel[1:])
        print(f"nccl PP=2 on 4 GPUs: multi-sender {m:.3f}s, funnel {f:.3f}s (x{f / m:.2f})")
        if os.environ.get("WS_BENCH_OUT"):
            with open(os.environ["WS_BENCH_OUT"] + ".nccl4.json", "w") as fh:
                json.dump({"multi_s": multi, "funnel_s": funnel, "speedup": f / m}, fh, indent=1)
        assert m < f, (multi, funnel)
    finally:
        t.stop()


def _changed_weights(trainer, tmp, tag: str, seed: int):
    """The trainer's export with 2 % of its values changed (what an optimizer step changes of bf16
    weights), as a checkpoint directory to load."""
    from safetensors.torch import load_file, save_file

    src, out = tmp / f"export-{tag}-src", tmp / f"weights-{tag}"
    res = wsctl("--address", trainer.address, "export", str(src))
    assert res.returncode == 0, res.stdout + res.stderr
    out.mkdir()
    shutil.copy(_model_dir(tmp) / "config.json", out / "config.json")
    g = torch.Generator().manual_seed(seed)
    sd = load_file(str(src / "model.safetensors"))
    for t in sd.values():
        mask = torch.rand(t.shape, generator=g) < 0.02
        t[mask] = t[mask] * 1.5 + 0.01
    save_file(sd, str(out / "model.safetensors"))
    shutil.rmtree(src)
    return out


@needs_gpus(4)
def test_pp2_over_nccl_with_sync_encoding_delta_every_stage_frames_deltas_on_its_own_group(fleet):
    """Trainer PP=2 on cuda:0 and cuda:1 with sync_encoding=delta, rollouts on cuda:2 and cuda:3: each
    stage diffs the buckets it owns against its part of the base (on its GPU) and broadcasts them as
    delta frames on its own group; the rollouts apply them onto their base copies (on their GPUs), exactly.
    Timed: the dense framed sync and the delta syncs (2 % of the values changed), on the same model as
    the test above (its multi-sender full sync time is the comparison)."""
    t = _pp2_trainer(fleet, "--sync-encoding", "delta")
    try:
        rs = _two_rollouts(fleet, t)
        args = ("--transport", "nccl", "--senders", "all")
        # the first sync keeps each stage's part unoffered; the second is offered, refused (the rollouts
        # hold no base yet), framed dense and kept by the rollouts
        dense = []
        for _ in range(2):
            rc, rep = _sync(t, *args)
            assert rc == 0 and rep["ok"] and sorted(int(s["rank"]) for s in rep["senders"]) == [0, 1], rep
            assert [r["encoding"] for r in rep["rollouts"]] == ["full", "full"], rep["rollouts"]
            dense.append(rep["seconds"])
        reps = int(os.environ.get("WS_MS_GPU_REPS", "3"))
        deltas = []
        for k in range(reps):
            changed = _changed_weights(t, fleet.tmp, f"d{k}", seed=k)
            res = wsctl("--address", t.address, "load", str(changed))
            assert res.returncode == 0, res.stdout + res.stderr
            shutil.rmtree(changed)
            rc, rep = _sync(t, *args)
            assert rc == 0 and rep["ok"] and sorted(int(s["rank"]) for s in rep["senders"]) == [0, 1], rep
            assert [r["encoding"] for r in rep["rollouts"]] == ["delta", "delta"], rep["rollouts"]
            total = int(rep["bytes"])
            assert all(int(r["wire_bytes"]) < 0.15 * total for r in rep["rollouts"]), (rep["rollouts"], total)
            deltas.append(rep["seconds"])
        for i, r in enumerate(rs):
            _assert_exact(
                r,
                _reference_logits(t, fleet.tmp, f"nccl-delta-{i}", f"cuda:{i + 2}", torch.float32),
                int(rep["version"]),
            )
        wire = [int(r["wire_bytes"]) / total for r in rep["rollouts"]]
        print(
            f"nccl PP=2 on 4 GPUs, sync_encoding=delta: dense framed {dense[1]:.3f}s, delta syncs "
            f"{', '.join(f'{s:.3f}' for s in deltas)}s, {wire[0]:.3f}x the bytes on each group"
        )
        if os.environ.get("WS_BENCH_OUT"):
            with open(os.environ["WS_BENCH_OUT"] + ".nccl4_delta.json", "w") as fh:
                json.dump({"dense_s": dense, "delta_s": deltas, "wire_ratio": wire, "bytes": total}, fh, indent=1)
    finally:
        t.stop()
