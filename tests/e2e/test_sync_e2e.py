"""Issue #2 acceptance: real trainer-svc and rollout-svc processes on loopback, driven by wsctl."""

import json
import socket

import numpy as np
import torch

from weightsync.control.client import channel, rollout_stub, trainer_stub
from weightsync.local.procs import free_port, wsctl
from weightsync.v1 import rollout_pb2, trainer_pb2

PROMPT = [5, 17, 42, 7, 99, 3]


def _rollout_rpc(proc):
    return rollout_stub(channel(proc.address), token="", timeout=60)


def _last_logits(proc, ids=PROMPT):
    r = _rollout_rpc(proc).Score(rollout_pb2.ScoreRequest(token_ids=ids, prompt_length=1, return_last_logits=True))
    return torch.from_numpy(np.frombuffer(r.last_logits_f32, dtype="<f4").copy()), r.version


def _greedy(proc, ids=PROMPT, n_new=8):
    req = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=ids)],
        return_logprobs=True,
        sampling=rollout_pb2.SamplingParams(max_new_tokens=n_new, temperature=0.0),
    )
    return _rollout_rpc(proc).Generate(req)


def _status(trainer):
    out = wsctl("--address", trainer.address, "--json", "status")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _hf_logits(model_dir, ids=PROMPT):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.set_num_threads(1)  # as the rollout process runs (weightsync.local.procs): same reduction order
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0, -1].float()


def test_sync_makes_rollout_compute_the_trainers_function_and_versions_agree(procs):
    trainer = procs.trainer("--model", "tiny-qwen2", "--init-seed", "1", "--no-auto-sync-new-rollouts")
    trainer.wait_ready()
    rollout = procs.rollout("--model", "tiny-qwen2", "--init-seed", "2", "--trainer-address", trainer.address)
    rollout.wait_ready()
    before, v0 = _last_logits(rollout)
    assert v0 == 0

    out = wsctl("--address", trainer.address, "--json", "sync")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and report["rollouts"][0]["ok"]
    # the path it took: tcp from rank 0, float32 (the trainer's export_dtype default), dense buckets
    # (the rollout holds no base yet)
    assert report["route"] == "tcp/single/fp32/full", report
    version = int(report["version"])

    export_dir = procs.tmp / "exported"
    assert wsctl("--address", trainer.address, "export", str(export_dir)).returncode == 0
    after, v1 = _last_logits(rollout)
    assert v1 == version
    expected = _hf_logits(str(export_dir))
    assert torch.equal(after, expected), (after - expected).abs().max()
    assert not torch.equal(before, after)

    st = _status(trainer)
    assert int(st["version"]) == version
    (r,) = st["rollouts"]
    assert int(r["version"]) == version and r["state"] == "SERVING" and r["reachable"]
    assert rollout.metric("weightsync_weights_version", 'role="rollout"') == version
    assert trainer.metric("weightsync_weights_version", 'role="trainer"') == version
    assert rollout.metric("weightsync_syncs_total", 'outcome="committed",role="rollout"') == 1
    assert trainer.metric("weightsync_sync_bytes_total", 'role="trainer"') == int(report["bytes"])
    # where the time went: every phase timed once, and together they are the sync's time
    # (stream.export and stream.pack are parts of stream, overlapping its sends: not added again)
    timed = report["phase_seconds"]
    phases = {k: v for k, v in timed.items() if "." not in k}
    assert sorted(phases) == ["commit", "plan", "prepare", "stream"], timed
    assert sorted(set(timed) - set(phases)) == ["stream.export", "stream.pack"], timed
    assert 0 < timed["stream.export"] <= timed["stream.pack"] <= phases["stream"], timed
    assert all(v > 0 for v in phases.values()) and sum(phases.values()) <= report["seconds"], (phases, report)
    assert sum(phases.values()) > 0.5 * report["seconds"], (phases, report)
    for name in timed:
        labels = f'phase="{name}",role="trainer",route="tcp/single/fp32/full"'
        assert trainer.metric("weightsync_sync_phase_seconds_count", labels) == 1
    human = wsctl("--address", trainer.address, "status")
    assert "phases: plan" in human.stdout, human.stdout


def test_new_weights_change_outputs_and_flush_the_prefix_cache(procs):
    trainer = procs.trainer("--model", "tiny-qwen2", "--init-seed", "1")
    trainer.wait_ready()
    rollout = procs.rollout("--model", "tiny-qwen2", "--init-seed", "2", "--trainer-address", trainer.address)
    rollout.wait_ready()
    # auto catch-up sync on registration brings the rollout to the trainer's version (polled over
    # gRPC: a wsctl call is a Python start-up, seconds on a busy box)
    import time

    tstub = trainer_stub(channel(trainer.address), token="", timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rollouts = tstub.GetStatus(trainer_pb2.TrainerStatusRequest()).rollouts
        if rollouts and rollouts[0].version != 0:
            break
        time.sleep(0.05)
    v1 = int(_status(trainer)["version"])
    assert int(_status(trainer)["rollouts"][0]["version"]) == v1

    first = _greedy(rollout)
    again = _greedy(rollout)
    assert again.samples[0].prefix_cache_hit and list(again.samples[0].token_ids) == list(first.samples[0].token_ids)

    # perturb: export, add noise, load into the trainer, sync
    export_dir, perturbed = procs.tmp / "e", procs.tmp / "p"
    assert wsctl("--address", trainer.address, "export", str(export_dir)).returncode == 0
    from safetensors.torch import load_file, save_file

    state = load_file(str(export_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    state = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    perturbed.mkdir()
    save_file(state, str(perturbed / "model.safetensors"))
    (perturbed / "config.json").write_text((export_dir / "config.json").read_text())
    out = wsctl("--address", trainer.address, "load", str(perturbed))
    assert out.returncode == 0, out.stderr
    out = wsctl("--address", trainer.address, "--json", "sync")
    assert out.returncode == 0, out.stdout + out.stderr
    v2 = int(json.loads(out.stdout)["version"])
    assert v2 > v1

    after = _greedy(rollout)
    assert after.version == v2
    assert not after.samples[0].prefix_cache_hit, "a prefix cached before the sync was reused after it"
    logits, _ = _last_logits(rollout)
    assert torch.equal(logits, _hf_logits(str(perturbed)))
    assert list(after.samples[0].logprobs) != list(first.samples[0].logprobs)


def test_unreachable_rollout_fails_cleanly(procs):
    dead = f"127.0.0.1:{free_port()}"
    trainer = procs.trainer("--model", "tiny-qwen2", "--rollouts", dead, "--rpc-timeout-s", "3")
    trainer.wait_ready()
    out = wsctl("--address", trainer.address, "--json", "sync")
    assert out.returncode == 1
    rep = json.loads(out.stdout)
    assert not rep["ok"] and "UNAVAILABLE" in rep["rollouts"][0]["error"]
    st = _status(trainer)
    assert st["rollouts"][0]["reachable"] is False


def test_port_in_use_is_a_clear_startup_error(procs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = procs.rollout("--model", "tiny-qwen2", grpc_port=port)
        assert r.popen.wait(60) != 0
        assert f"127.0.0.1:{port}" in r.log() and "port" in r.log().lower()


def test_shape_mismatch_is_rejected_and_rollout_keeps_serving(procs):
    from transformers import Qwen2Config

    from weightsync.models import TINY

    kw = dict(TINY["tiny-qwen2"])
    kw.pop("model_type")
    kw["intermediate_size"] = 96
    d = procs.tmp / "other"
    Qwen2Config(**kw).save_pretrained(str(d))

    trainer = procs.trainer("--model", "tiny-qwen2", "--no-auto-sync-new-rollouts")
    trainer.wait_ready()
    rollout = procs.rollout("--model", str(d), "--trainer-address", trainer.address)
    rollout.wait_ready()
    before, _ = _last_logits(rollout)
    out = wsctl("--address", trainer.address, "--json", "sync")
    assert out.returncode == 1
    err = json.loads(out.stdout)["rollouts"][0]["error"]
    assert "INVALID_ARGUMENT" in err and "mlp" in err and "engine expects [96, 64]" in err
    after, version = _last_logits(rollout)
    assert version == 0 and torch.equal(before, after)
    assert _greedy(rollout).version == 0


def test_admin_calls_need_the_token(procs, tmp_path):
    tok = tmp_path / "token"
    tok.write_text("s3cret\n")
    tok.chmod(0o600)  # a token file others can read is refused
    trainer = procs.trainer("--model", "tiny-qwen2", "--auth-token-file", str(tok))
    trainer.wait_ready()
    denied = wsctl("--address", trainer.address, "status")
    assert denied.returncode == 3 and "UNAUTHENTICATED" in denied.stderr
    ok = wsctl("--address", trainer.address, "--token-file", str(tok), "status")
    assert ok.returncode == 0, ok.stderr
