"""Write what an actor exports as a transformers-loadable directory (config.json + safetensors).

This is the same exporter the weight bus uses, so a directory written here is exactly what
every rollout receives — tests load it with `transformers` to check the rollout's logits.
"""

from __future__ import annotations

from pathlib import Path

from trainer_svc.atomic_file import save_config, save_safetensors


def save_hf_dir(actor, out_dir: str, fmt=None) -> int:
    """`fmt`: the trainer's ExportFormat (weightsync.publisher.export_format); None = as the actor exports."""
    out = Path(out_dir)
    named = fmt.tensors(actor.export_tensors()) if fmt is not None else actor.export_tensors()
    # Read to its end before anything is written: a quantized export refuses non-finite weights
    # only after its last tensor (weightsync/formats/fp8/export.py), and a failed export must
    # leave no directory behind, nor touch one that already holds an export.
    tensors = {name: t.detach().cpu().contiguous() for name, t in named}
    out.mkdir(parents=True, exist_ok=True)
    if tensors:  # non-sender ranks of a multi-rank actor get nothing and write nothing
        # each file replaced whole: a reader (LoadWeights) or a crash mid-write never sees half of one
        save_safetensors(tensors, out / "model.safetensors")
        save_config(fmt.hf_config(actor.hf_config()) if fmt is not None else actor.hf_config(), out)
    return len(tensors)
