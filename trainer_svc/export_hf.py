"""Write what an actor exports as a transformers-loadable directory (config.json + safetensors).

This is the same exporter the weight bus uses, so a directory written here is exactly what
every rollout receives — tests load it with `transformers` to check the rollout's logits.
"""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file


def save_hf_dir(actor, out_dir: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous() for name, t in actor.export_tensors()}
    if tensors:  # non-sender ranks of a multi-rank actor get nothing and write nothing
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        actor.hf_config().save_pretrained(str(out))
    return len(tensors)
