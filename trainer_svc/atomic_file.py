"""Write a file so that readers see the old one or the whole new one, never part of it.

Exports and checkpoints are read by other processes (a rollout's LoadWeights, a resumed trainer)
and may be overwritten in place; a process killed mid-write must leave the previous file intact.
The bytes go to a temporary name beside the target (same filesystem) and are renamed over it.
Every file is made 0600 before it appears: weights, optimizer state and configs are the trainer's
alone (readers run as the same user).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        if tmp.exists():  # the write failed: leave no stray partial file
            tmp.unlink()


def save_safetensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    atomic_write(path, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))


def save_config(hf_config, directory: Path) -> None:
    """config.json as `save_pretrained` writes it (only the values that differ from the defaults)."""
    atomic_write(Path(directory) / "config.json", lambda p: hf_config.to_json_file(str(p), use_diff=True))
