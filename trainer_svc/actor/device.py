"""Where an actor's export lives: the device the GPU transports pack and send from."""

from __future__ import annotations

import torch

from weightsync.config import ConfigError


def resolve_device(spec: str) -> torch.device:
    """The torch device of a `device` setting ("" = cpu), checked against what this host has."""
    dev = torch.device(spec or "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={spec}: torch sees no CUDA device on this host (use device=cpu)")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"device={spec}: this host has {torch.cuda.device_count()} CUDA device(s) (check CUDA_VISIBLE_DEVICES)"
            )
        dev = torch.device("cuda", index)
    return dev


def export_device(actor) -> torch.device:
    """The actor's own `device`, else the device of its first parameter (megatron: cuda:LOCAL_RANK)."""
    dev = getattr(actor, "device", None)
    if dev is not None:
        return torch.device(dev)
    params = getattr(actor, "parameters", None)
    for p in params() if callable(params) else []:
        return p.device
    return torch.device("cpu")
