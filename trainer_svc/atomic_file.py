"""Write a file so that readers see the old one or the whole new one, never part of it.

Exports and checkpoints are read by other processes (a rollout's LoadWeights, a resumed trainer)
and may be overwritten in place; a process killed mid-write must leave the previous file intact.
The bytes go to a temporary name beside the target (same filesystem) and are renamed over it.
Every file is 0600 from its creation as a temporary file, so even a partial one left by a killed
process is not readable by others: weights, optimizer state and configs are the trainer's alone
(readers run as the same user). Such leftovers are removed at the next start (clean_leftovers).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

#: a temporary file's name: the target's, then ".tmp" and the writer's pid (clean_leftovers finds them)
TEMP_NAME = re.compile(r".+\.tmp\d+$")


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    if tmp.exists():  # left by an earlier process with this pid: O_EXCL below needs it gone
        tmp.unlink()
    # created 0600 before a byte is written: a process killed mid-write leaves no readable partial copy
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        write(tmp)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        if tmp.exists():  # the write failed: leave no stray partial file
            tmp.unlink()


def clean_leftovers(directory: Path) -> list[Path]:
    """Remove the temporary files a process killed mid-write left under `directory` (recursively);
    returns them. Call it before anything writes there (start-up): a live writer's temp is one too."""
    gone = []
    for p in sorted(Path(directory).rglob("*.tmp*")):
        if TEMP_NAME.match(p.name) and p.is_file() and not p.is_symlink():
            p.unlink()
            gone.append(p)
    return gone


def save_safetensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    atomic_write(path, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))


def save_config(hf_config, directory: Path) -> None:
    """config.json as `save_pretrained` writes it (only the values that differ from the defaults)."""
    atomic_write(Path(directory) / "config.json", lambda p: hf_config.to_json_file(str(p), use_diff=True))
