"""Training checkpoints: model, optimizer, reference model, RNG states, step and version, per rank.

Layout (every rank writes its own shard; rank 0 flips `latest` only after all of them are on disk):

    <dir>/step_00000012/rank_00000.pt   torch.save of this rank's state dicts
    <dir>/latest                        "step_00000012"

Each file is written to a temporary name and renamed, so a trainer killed mid-save leaves the
previous checkpoint intact and `latest` never points at a partial one.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

from trainer_svc.atomic_file import atomic_write, clean_leftovers
from trainer_svc.train.step import TrainState, train_state

log = logging.getLogger(__name__)
FORMAT = 1


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_checkpoint(actor, directory: str) -> Path:
    """Write this rank's shard of the training state under `directory`; returns the step dir."""
    st = train_state(actor)
    root = Path(directory)
    step_dir = root / f"step_{st.step:08d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "format": FORMAT,
        "step": st.step,
        "version": actor.version,
        "model": [m.state_dict() for m in st.backend.modules()],
        "optimizer": st.optimizer.state_dict(),
        "reference": None if st.reference is None else [m.state_dict() for m in st.reference],
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }
    rank = _rank()
    atomic_write(step_dir / f"rank_{rank:05d}.pt", lambda p: torch.save(state, p))
    st.backend.barrier()
    if rank == 0:
        atomic_write(root / "latest", lambda p: p.write_text(step_dir.name + "\n"))
    st.backend.barrier()
    log.info("checkpoint saved: %s (step %d, version %d)", step_dir, st.step, actor.version)
    return step_dir


def latest_checkpoint(directory: str) -> Path | None:
    marker = Path(directory) / "latest"
    if not marker.is_file():
        return None
    step_dir = Path(directory) / marker.read_text().strip()
    return step_dir if step_dir.is_dir() else None


def load_checkpoint(actor, step_dir: str | Path) -> TrainState:
    """Restore this rank's shard written by `save_checkpoint` (same backend and parallel layout)."""
    st = train_state(actor)
    path = Path(step_dir) / f"rank_{_rank():05d}.pt"
    if not path.is_file():
        raise ValueError(f"checkpoint {step_dir}: no shard {path.name} for this rank (saved with another layout?)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path}: format {state.get('format')} != {FORMAT}")
    modules = st.backend.modules()
    if len(state["model"]) != len(modules):
        raise ValueError(f"checkpoint {path}: {len(state['model'])} model chunks, this actor has {len(modules)}")
    for m, sd in zip(modules, state["model"]):
        m.load_state_dict(sd)
    st.optimizer.load_state_dict(state["optimizer"])
    if state["reference"] is not None:
        st.reference = st.backend.frozen_copy()
        for m, sd in zip(st.reference, state["reference"]):
            m.load_state_dict(sd)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    st.step = actor.step = int(state["step"])
    actor.version = int(state["version"])
    log.info("resumed from %s: step %d, version %d", step_dir, st.step, actor.version)
    return st


def resume_if_configured(actor, ckpt) -> bool:
    """`--resume`: load the latest checkpoint under the `checkpoint` section's checkpoint_dir, if any.
    First (resume or not), rank 0 removes the temporary files a trainer killed mid-save left there."""
    if ckpt.checkpoint_dir and _rank() == 0 and Path(ckpt.checkpoint_dir).is_dir():
        for p in clean_leftovers(Path(ckpt.checkpoint_dir)):
            log.warning("removed %s: a partial checkpoint file left by a trainer killed while saving", p)
    if not ckpt.resume:
        return False
    step_dir = latest_checkpoint(ckpt.checkpoint_dir)
    if step_dir is None:
        log.info("resume: no checkpoint under %s yet; starting fresh", ckpt.checkpoint_dir)
        return False
    load_checkpoint(actor, step_dir)
    return True
