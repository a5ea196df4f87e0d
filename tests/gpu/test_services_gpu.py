"""GPU transports through the real services (issue #4): trainer-svc and rollout-svc processes on
loopback gRPC, weights over NCCL (trainer on cuda:0, rollouts on the other GPUs) or CUDA IPC
(trainer and rollout on cuda:0). Run on a GPU host: pytest -m gpu tests/gpu/test_services_gpu.py.

Exactness: after a sync, a rollout's last-position logits equal, bit for bit, those of a reference
engine loaded from the trainer's own export (`wsctl export`) on the rollout's GPU — the same
weights, the same code, the same device.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from weightsync.control.client import channel, rollout_stub
from weightsync.local.procs import start_rollout, start_trainer, wait_registered, wsctl
from weightsync.v1 import rollout_pb2

pytestmark = pytest.mark.gpu
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
PROMPT = [5, 17, 42, 7, 99, 3, 1000, 2047]
# ~34 MB in fp32: 9 buckets at --bucket-mb 4, so double buffering and group reuse are exercised
MODEL_KW = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def needs_gpus(n: int):
    return pytest.mark.skipif(NGPU < n, reason=f"needs {n} CUDA GPUs, found {NGPU}")


@pytest.fixture
def fleet(tmp_path):
    """Start processes through this fixture so they are always stopped; logs are printed on failure."""
    started = []

    def trainer(*args, backend="hf"):
        p = start_trainer(
            tmp_path,
            "--backend",
            backend,
            "--model",
            str(_model_dir(tmp_path)),
            "--bucket-mb",
            "4",
            "--no-auto-sync-new-rollouts",
            *args,
        )
        started.append(p)
        return p

    def rollout(name, *args, trainer_proc=None):
        extra = ("--trainer-address", trainer_proc.address) if trainer_proc else ()
        p = start_rollout(tmp_path, "--model", str(_model_dir(tmp_path)), "--init-seed", "2", *extra, *args, name=name)
        started.append(p)
        return p

    class F:
        pass

    F.trainer, F.rollout, F.tmp = staticmethod(trainer), staticmethod(rollout), tmp_path
    yield F
    for p in started:
        p.stop()
    for p in started:
        print(f"----- {p.name} log (tail) -----\n{p.log()[-3000:]}")


def _model_dir(root):
    d = root / "model"
    if not (d / "config.json").exists():
        from transformers import Qwen2Config

        Qwen2Config(**MODEL_KW).save_pretrained(str(d))
    return d


def _weights_dir(root, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = root / f"weights-{seed}"
    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(**MODEL_KW)).save_pretrained(str(d), safe_serialization=True)
    return d


def _sync(trainer, *args):
    out = wsctl("--address", trainer.address, "--json", "sync", *args, timeout=300)
    assert out.stdout, out.stderr
    return out.returncode, json.loads(out.stdout)


def _rollout_logits(proc):
    r = rollout_stub(channel(proc.address), "", 60).Score(
        rollout_pb2.ScoreRequest(token_ids=PROMPT, prompt_length=1, return_last_logits=True)
    )
    return torch.from_numpy(np.frombuffer(r.last_logits_f32, dtype="<f4").copy()), r.version


def _reference_logits(trainer, tmp, tag: str, device: str, dtype: torch.dtype):
    from safetensors.torch import load_file

    from rollout_svc.engine.builtin import BuiltinEngine
    from weightsync.models import resolve_model

    out_dir = tmp / f"export-{tag}"
    res = wsctl("--address", trainer.address, "export", str(out_dir))
    assert res.returncode == 0, res.stdout + res.stderr
    # Built the way the rollout builds its engine (from the config, then load_weights): only the
    # weights may differ. (from_pretrained in bf16 would keep rotary inv_freq in fp32, unlike .to(bf16).)
    engine = BuiltinEngine.from_config(resolve_model(str(_model_dir(tmp)))[0], seed=0, dtype=dtype, device=device)
    engine.load_weights(load_file(str(out_dir / "model.safetensors"), device=device).items())
    logits = engine.score(PROMPT, 1)[1]
    del engine
    torch.cuda.empty_cache()
    return logits


def _assert_exact(rollout, expected, version):
    got, v = _rollout_logits(rollout)
    assert v == version, f"{rollout.name} serves version {v}, the sync published {version}"
    assert torch.equal(got, expected), f"{rollout.name}: max |diff| {(got - expected).abs().max()}"


def _load(trainer, weights_dir) -> None:
    res = wsctl("--address", trainer.address, "load", str(weights_dir))
    assert res.returncode == 0, res.stdout + res.stderr


@needs_gpus(2)
def test_nccl_sync_through_the_services_is_exact_reuses_the_group_and_rebuilds_it_for_a_new_member(fleet):
    t = fleet.trainer("--device", "cuda:0", "--transport", "nccl", "--init-seed", "1")
    t.wait_ready()
    r1 = fleet.rollout("r1", "--device", "cuda:1", "--apply-mode", "inplace", trainer_proc=t)
    r1.wait_ready()
    wait_registered(t.address, ["r1"])
    before, _ = _rollout_logits(r1)

    rc, rep = _sync(t)
    assert rc == 0 and rep["ok"] and rep["transport"] == "nccl", rep
    version = int(rep["version"])
    expected = _reference_logits(t, fleet.tmp, "v1", "cuda:1", torch.float32)
    _assert_exact(r1, expected, version)
    assert not torch.equal(before, expected)
    assert t.metric("weightsync_nccl_group_builds_total", 'role="trainer"') == 1
    assert r1.metric("weightsync_nccl_group_builds_total", 'role="rollout"') == 1
    print(f"nccl sync 1: {rep['bytes']} B in {rep['num_buckets']} buckets, {rep['seconds']:.3f}s")

    # new weights, same membership: the cached group carries the sync
    _load(t, _weights_dir(fleet.tmp, 7))
    rc, rep = _sync(t)
    assert rc == 0 and rep["ok"], rep
    _assert_exact(r1, _reference_logits(t, fleet.tmp, "v2", "cuda:1", torch.float32), int(rep["version"]))
    assert t.metric("weightsync_nccl_group_builds_total", 'role="trainer"') == 1
    assert r1.metric("weightsync_nccl_group_builds_total", 'role="rollout"') == 1

    # a new member: a new group. NCCL takes one rank per GPU, so with two GPUs the new rollout
    # shares cuda:1 with r1 and the two are synced in turn (each sync is a membership change).
    r2 = fleet.rollout("r2", "--device", "cuda:2" if NGPU >= 3 else "cuda:1", trainer_proc=t)
    r2.wait_ready()
    wait_registered(t.address, ["r1", "r2"])
    _load(t, _weights_dir(fleet.tmp, 8))
    if NGPU >= 3:
        rc, rep = _sync(t)
        assert rc == 0 and rep["ok"] and len(rep["rollouts"]) == 2, rep
        version = int(rep["version"])
        _assert_exact(r1, _reference_logits(t, fleet.tmp, "v3-r1", "cuda:1", torch.float32), version)
        _assert_exact(r2, _reference_logits(t, fleet.tmp, "v3-r2", "cuda:2", torch.float32), version)
        assert t.metric("weightsync_nccl_group_builds_total", 'role="trainer"') == 2
    else:
        expected = _reference_logits(t, fleet.tmp, "v3", "cuda:1", torch.float32)
        for n, (rid, proc) in enumerate((("r2", r2), ("r1", r1))):
            rc, rep = _sync(t, "--rollout", rid)
            assert rc == 0 and rep["ok"], rep
            _assert_exact(proc, expected, int(rep["version"]))
            assert t.metric("weightsync_nccl_group_builds_total", 'role="trainer"') == 2 + n
    assert r1.metric("weightsync_nccl_group_builds_total", 'role="rollout"') == 2
    assert r2.metric("weightsync_nccl_group_builds_total", 'role="rollout"') == 1


@needs_gpus(2)
def test_nccl_member_that_cannot_take_part_never_holds_back_the_others_for_long(fleet):
    """With 3+ GPUs a member on a GPU of its own cannot join (no network interface): the trainer's
    join times out, the whole group fails (a collective needs every rank), the good rollout keeps
    serving, and the next sync without the bad one builds a new group. With 2 GPUs the second
    rollout must share cuda:1, which the trainer refuses at prepare (one NCCL rank per GPU): the
    good rollout is synced in the same call, in a group without it."""
    t = fleet.trainer("--device", "cuda:0", "--transport", "nccl", "--init-seed", "1", "--nccl-init-timeout-s", "15")
    t.wait_ready()
    good = fleet.rollout("good", "--device", "cuda:1", trainer_proc=t)
    good.wait_ready()
    # registered first, so listed first: of two rollouts on one GPU, the first listed keeps it
    wait_registered(t.address, ["good"])
    bad_env = {"NCCL_SOCKET_IFNAME": "no-such-if0"}
    bad = _rollout_with_env(fleet, "bad", bad_env, "--device", "cuda:2" if NGPU >= 3 else "cuda:1", trainer_proc=t)
    bad.wait_ready()
    wait_registered(t.address, ["good", "bad"])
    before, v0 = _rollout_logits(good)

    t0 = time.monotonic()
    rc, rep = _sync(t)
    took = time.monotonic() - t0
    assert rc == 1 and not rep["ok"], rep
    by = {r["rollout_id"]: r for r in rep["rollouts"]}
    print("failure:", {k: r.get("error", "") for k, r in by.items()})
    if NGPU >= 3:
        assert all("NCCL group init" in r["error"] for r in by.values()), by
        assert took < 60, f"the failed sync took {took:.0f}s (init timeout 15s)"
        after, v1 = _rollout_logits(good)  # staged: still serving its previous weights
        assert v1 == v0 and torch.equal(after, before)
        assert t.metric("weightsync_nccl_group_builds_total", 'role="trainer"') == 0
        rc, rep = _sync(t, "--rollout", "good")
        assert rc == 0 and rep["ok"], rep
    else:
        assert "NCCL takes one rank per GPU" in by["bad"]["error"], by
        assert by["good"].get("ok"), by
        assert took < 15, f"refused at prepare, yet the sync took {took:.0f}s"
    _assert_exact(good, _reference_logits(t, fleet.tmp, "after-failure", "cuda:1", torch.float32), int(rep["version"]))
    assert t.metric("weightsync_nccl_group_builds_total", 'role="trainer"') == 1


@needs_gpus(2)
def test_megatron_trainer_exports_on_its_gpu_and_syncs_exactly_over_nccl(fleet):
    pytest.importorskip("megatron.core")
    t = fleet.trainer("--transport", "nccl", "--init-seed", "3", backend="megatron")
    t.wait_ready(timeout=240)
    r = fleet.rollout("r-mcore", "--device", "cuda:1", trainer_proc=t)
    r.wait_ready()
    wait_registered(t.address, ["r-mcore"])
    # nccl is refused unless the actor's parameters are on a CUDA device (trainer_svc.actor.device.export_device)
    rc, rep = _sync(t)
    assert rc == 0 and rep["ok"] and rep["transport"] == "nccl", rep
    _assert_exact(r, _reference_logits(t, fleet.tmp, "mcore", "cuda:1", torch.float32), int(rep["version"]))


def _rollout_with_env(fleet, name, env, *args, trainer_proc=None):
    import os

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fleet.rollout(name, *args, trainer_proc=trainer_proc)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@needs_gpus(1)
def test_ipc_colocated_sync_is_exact_in_bf16_and_a_rollout_on_another_gpu_is_refused(fleet):
    t = fleet.trainer("--device", "cuda:0", "--transport", "ipc", "--export-dtype", "bfloat16", "--init-seed", "1")
    t.wait_ready()
    same = fleet.rollout("same-gpu", "--device", "cuda:0", "--dtype", "bfloat16", trainer_proc=t)
    same.wait_ready()
    ids = ["same-gpu"]
    other = None
    if NGPU >= 2:
        other = fleet.rollout("other-gpu", "--device", "cuda:1", "--dtype", "bfloat16", trainer_proc=t)
        other.wait_ready()
        ids.append("other-gpu")
    wait_registered(t.address, ids)

    rc, rep = _sync(t, "--rollout", "same-gpu")
    assert rc == 0 and rep["ok"] and rep["transport"] == "ipc", rep
    _assert_exact(same, _reference_logits(t, fleet.tmp, "ipc1", "cuda:0", torch.bfloat16), int(rep["version"]))

    _load(t, _weights_dir(fleet.tmp, 9))
    rc, rep = _sync(t, "--rollout", "same-gpu")
    assert rc == 0 and rep["ok"], rep
    _assert_exact(same, _reference_logits(t, fleet.tmp, "ipc2", "cuda:0", torch.bfloat16), int(rep["version"]))

    if other is not None:
        rc, rep = _sync(t, "--rollout", "other-gpu")
        assert rc == 1 and not rep["ok"], rep
        (r,) = rep["rollouts"]
        assert "CUDA IPC needs both on one GPU" in r["error"], r
        # the refused rollout still serves its own initial weights (version 0)
        assert _rollout_logits(other)[1] == 0


@needs_gpus(1)
@pytest.mark.parametrize("apply_mode", ["staged", "inplace"])
def test_ipc_bf16_trainer_sends_its_own_parameters_and_each_buffer_is_mapped_once(fleet, apply_mode):
    """hf trainer holding bf16 = the export as it is: no pack copy (its parameters live in the
    buckets' layout), one IpcBuckets stream per sync, and the rollout maps each buffer once: later
    syncs, even of new weights, open no handle. Every sync exact, in both apply modes: staged
    copies each bucket once (copy_bucket), inplace writes it into the engine's parameters in the
    same pass as its checksum (copy_into's one-launch kernel)."""
    t = fleet.trainer(
        "--device",
        "cuda:0",
        "--transport",
        "ipc",
        "--export-dtype",
        "bfloat16",
        "--param-dtype",
        "bfloat16",
        "--init-seed",
        "1",
        "--ipc-direction",
        "rollout_reads",  # the rollout maps the trainer's buffers (test_trainer_writes_gpu.py: the other way)
    )
    t.wait_ready()
    r = fleet.rollout(
        "same-gpu", "--device", "cuda:0", "--dtype", "bfloat16", "--apply-mode", apply_mode, trainer_proc=t
    )
    r.wait_ready()
    wait_registered(t.address, ["same-gpu"])
    opens = lambda: r.metric("weightsync_ipc_handle_opens_total", 'role="rollout"')  # noqa: E731
    rc, rep = _sync(t, "--rollout", "same-gpu")
    assert rc == 0 and rep["ok"] and rep["transport"] == "ipc", rep
    first_opens = opens()
    assert first_opens == rep["num_buckets"] == r.metric("weightsync_ipc_mapped_buffers", 'role="rollout"'), rep
    _assert_exact(r, _reference_logits(t, fleet.tmp, "own1", "cuda:0", torch.bfloat16), int(rep["version"]))
    for i, seed in enumerate((9, 10)):
        _load(t, _weights_dir(fleet.tmp, seed))
        rc, rep = _sync(t, "--rollout", "same-gpu")
        assert rc == 0 and rep["ok"], rep
        _assert_exact(r, _reference_logits(t, fleet.tmp, f"own{seed}", "cuda:0", torch.bfloat16), int(rep["version"]))
        assert opens() == first_opens, f"sync {i + 2} mapped handles again"


@needs_gpus(1)
def test_megatron_bf16_trainer_syncs_exactly_over_ipc_from_its_own_buckets_mapping_each_once(fleet):
    """The real case of the benchmark: megatron-core parameters in bf16, colocated rollout. Its export
    goes straight into the buckets (trainer_svc/actor/megatron/flat_export.py): the parameters that are
    their own HF bytes live there, QKV and the fp32 norms are written into their slots at each sync, so
    the rollout maps each bucket once and later syncs, of new weights too (LoadWeights), open no handle."""
    pytest.importorskip("megatron.core")
    t = fleet.trainer(
        "--transport",
        "ipc",
        "--init-seed",
        "3",
        "--param-dtype",
        "bfloat16",
        "--export-dtype",
        "bfloat16",
        "--ipc-direction",
        "rollout_reads",  # the rollout maps the trainer's buckets (test_trainer_writes_gpu.py: the other way)
        backend="megatron",
    )
    t.wait_ready(timeout=240)
    r = fleet.rollout("r-mcore-ipc", "--device", "cuda:0", "--dtype", "bfloat16", trainer_proc=t)
    r.wait_ready()
    wait_registered(t.address, ["r-mcore-ipc"])
    opens = []
    for i in range(3):
        if i == 2:  # loaded in place into the parameters that live in the buckets
            _load(t, _weights_dir(fleet.tmp, 12))
        rc, rep = _sync(t)
        assert rc == 0 and rep["ok"] and rep["transport"] == "ipc", rep
        assert rep["num_buckets"] > 2, rep
        opens.append(r.metric("weightsync_ipc_handle_opens_total", 'role="rollout"'))
        _assert_exact(
            r, _reference_logits(t, fleet.tmp, f"mcore-ipc{len(opens)}", "cuda:0", torch.bfloat16), int(rep["version"])
        )
    # every bucket is the trainer's own storage, mapped by the first sync only
    assert opens[0] == opens[1] == opens[2] == rep["num_buckets"], opens
