"""Write an HF directory (config.json + safetensors) from an export iterator, holding at most one
output shard in memory; each file is replaced whole (trainer_svc/atomic_file.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from trainer_svc.atomic_file import atomic_write, save_config, save_safetensors
from weightsync.bus.plan import TensorMeta

MAX_SHARD_BYTES = 2 << 30


def write_hf_dir(
    out_dir: str,
    hf_config,
    metas: list[TensorMeta],
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # plan the shards from metadata so file names are known before the first tensor arrives
    groups: list[list[str]] = [[]]
    size = 0
    for m in metas:
        if groups[-1] and size + m.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(m.name)
        size += m.nbytes
    n = len(groups)
    file_of = {}
    for i, names in enumerate(groups):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        file_of.update({name: fname for name in names})
    written, pending = [], {}
    it = iter(tensors)
    for names in groups:
        for name in names:
            got, t = next(it)
            if got != name:
                raise ValueError(f"tensor {got}: exported out of order, expected {name}")
            t = t.detach().cpu().contiguous()
            if any(t.data_ptr() == o.data_ptr() for o in pending.values()):
                # the export yields parameters' own memory where it can, so a tensor written twice
                # (DeepSeek's MTP copies of embedding and head) arrives twice: safetensors wants two
                t = t.clone()
            pending[name] = t
        path = out / file_of[names[0]]
        save_safetensors(pending, path)
        written.append(path)
        pending = {}
    if n > 1:
        total = sum(m.nbytes for m in metas)
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": file_of}, indent=2)
        atomic_write(out / "model.safetensors.index.json", lambda p: p.write_text(index))
    save_config(hf_config, out)
    return written
