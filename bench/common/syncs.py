"""Helpers of the benches that drive syncs through the services: changing a trainer's values as an
optimizer step would, and one sync's report as a result row."""

from __future__ import annotations


def change_values(model, fraction: float, g) -> None:
    """About `fraction` of the values change (random positions, drawn with replacement: a few repeat)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            idx = torch.randint(flat.numel(), (round(flat.numel() * fraction),), generator=g)
            flat[idx] = (flat[idx].float() * 1.5 + 0.01).to(p.dtype)


def sync_row(rep) -> dict:
    """One SyncReport (trainer_pb2) as a row: seconds, bytes, wire bytes, phases, the first rollout's encoding."""
    r = rep.rollouts[0]
    return {
        "seconds": rep.seconds,
        "stream_s": rep.phase_seconds.get("stream", 0.0),
        "encoding": r.encoding,
        "bytes": rep.bytes,
        "wire_bytes": rep.wire_bytes,
        "phase_seconds": dict(rep.phase_seconds),
    }
