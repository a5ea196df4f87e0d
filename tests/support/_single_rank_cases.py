"""One megatron-core process (plain python, one-rank gloo group): error messages, version bumps,
seeded init, and that backward runs on CPU. Writes a JSON report to argv[2]; argv[1] is a work dir
holding the conftest's HF dirs."""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _err(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def main() -> None:
    from safetensors.torch import load_file, save_file

    from tests.support.megatron_models import make_config, save_random_hf
    from trainer_svc.actor.megatron.actor import MegatronActor
    from trainer_svc.actor.megatron.model import forward_logits

    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    rep: dict = {}
    try:
        src = work / "qwen2"
        actor = MegatronActor(make_config("qwen2"), seed=7)
        rep["seeded_equal"] = all(
            torch.equal(a[1], b[1])
            for a, b in zip(actor.export_tensors(), MegatronActor(make_config("qwen2"), seed=7).export_tensors())
        )
        other = dict(MegatronActor(make_config("qwen2"), seed=8).export_tensors())
        rep["seed_changes_weights"] = not torch.equal(
            other["model.norm.weight"], dict(actor.export_tensors())["model.norm.weight"]
        ) or not torch.equal(
            other["model.layers.0.mlp.up_proj.weight"],
            dict(actor.export_tensors())["model.layers.0.mlp.up_proj.weight"],
        )
        v0 = actor.version
        actor.load_hf(str(src))
        rep["version_bump"] = [v0, actor.version]

        missing = work / "missing"
        shutil.copytree(src, missing)
        sd = load_file(str(missing / "model.safetensors"))
        del sd["model.layers.1.mlp.up_proj.weight"]
        save_file(sd, str(missing / "model.safetensors"), metadata={"format": "pt"})
        rep["missing"] = _err(lambda: actor.load_hf(str(missing)))

        wrong = save_random_hf(make_config("qwen2", intermediate_size=96), work / "wrong")
        rep["shape"] = _err(lambda: actor.load_hf(str(wrong)))
        rep["act"] = _err(lambda: MegatronActor(make_config("llama", hidden_act="gelu")))
        rep["empty_dir"] = _err(lambda: actor.load_hf(str(work)))

        # Llama 3.1 RoPE scaling (frequencies past 8192 positions' wavelength divided by `factor`)
        from transformers import AutoModelForCausalLM

        l3 = make_config(
            "llama",
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_theta": 500000.0,
            },
        )
        l3_dir = save_random_hf(l3, work / "llama3")
        l3_actor = MegatronActor(l3, weights_dir=str(l3_dir))
        ids = torch.randint(0, 250, (2, 64))
        with torch.no_grad():
            got = forward_logits(l3_actor.model, ids, 250)
            want = AutoModelForCausalLM.from_pretrained(str(l3_dir), dtype=torch.float32).eval()(ids).logits
        rep["llama3_rope_rel_err"] = float((got - want).norm() / want.norm())
        bad = make_config("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
        rep["rope_type"] = _err(lambda: MegatronActor(bad))

        # backward through the whole CPU model (the compat layer's RNG tracker and masks included)
        actor.load_hf(str(src))
        ids = torch.randint(0, 250, (2, 8))
        loss = forward_logits(actor.model, ids, 250).float().logsumexp(-1).mean()
        loss.backward()
        grads = [p.grad for p in actor.parameters()]
        rep["backward"] = all(g is not None and torch.isfinite(g).all().item() for g in grads) and any(
            g.abs().sum().item() > 0 for g in grads
        )
    except Exception:
        rep["error"] = traceback.format_exc()
    out.write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
    # the report is written: end without the interpreter's teardown of torch and megatron (seconds
    # per process on a busy 2-core box, paid by every rank of every launch)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
