"""export_dtype=fp8-block through the real services: trainer-svc and rollout-svc on loopback (TCP)."""

import json

import numpy as np
import torch

from weightsync.control.client import channel, rollout_stub
from weightsync.formats.fp8 import blocks as fp8
from weightsync.local.procs import wsctl
from weightsync.v1 import rollout_pb2

PROMPT = [5, 17, 42, 7, 99, 3]


def _last_logits(proc):
    stub = rollout_stub(channel(proc.address), token="", timeout=60)
    r = stub.Score(rollout_pb2.ScoreRequest(token_ids=PROMPT, prompt_length=1, return_last_logits=True))
    return torch.from_numpy(np.frombuffer(r.last_logits_f32, dtype="<f4").copy()), r.version


def test_fp8_sync_commits_and_the_rollout_serves_the_exported_fp8_checkpoint(procs):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    trainer = procs.trainer(
        "--model", "tiny-qwen2", "--init-seed", "1", "--export-dtype", "fp8-block", "--no-auto-sync-new-rollouts"
    )
    trainer.wait_ready()
    rollout = procs.rollout("--model", "tiny-qwen2", "--init-seed", "2", "--trainer-address", trainer.address)
    rollout.wait_ready()
    out = wsctl("--address", trainer.address, "--json", "sync")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and report["rollouts"][0]["ok"], report
    logits, version = _last_logits(rollout)
    assert version == int(report["version"])

    # ExportHf writes the same stream as a block-FP8 checkpoint
    export_dir = procs.tmp / "exported-fp8"
    assert wsctl("--address", trainer.address, "export", str(export_dir)).returncode == 0
    tensors = load_file(str(export_dir / "model.safetensors"))
    qc = json.loads((export_dir / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float8_e4m3fn and tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (
        1,
        1,
    )
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    # manifest bytes = what the checkpoint holds, up to the bus's 256-byte alignment per tensor
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    assert held <= int(report["bytes"]) < held + 256 * len(tensors)

    # the rollout (float32 engine) serves exactly that checkpoint, dequantized
    state = {}
    for name, t in tensors.items():
        if name.endswith(fp8.SCALE_SUFFIX):
            continue
        state[name] = fp8.dequantize(t, tensors[fp8.scale_name(name)]) if t.dtype == fp8.FP8_DTYPE else t.float()
    config = AutoConfig.from_pretrained(str(export_dir))
    del config.quantization_config  # loaded by hand above; transformers' FP8 path needs a GPU
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(state)
    torch.set_num_threads(1)  # as the rollout process runs: same reduction order
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0, -1].float()
    assert torch.equal(logits, expected), (logits - expected).abs().max()
