"""A whole sync's buckets built in the test itself: the manifest of named tensors and each bucket packed
exactly as a trainer packs it (checksummed with the bus's algorithm), for tests that feed a rollout's
transaction or engine without a trainer."""

from __future__ import annotations

import torch

from weightsync.bus.copy.checksum import ALGO
from weightsync.bus.pack import alloc_buffer, pack_bucket
from weightsync.bus.plan import Manifest, TensorMeta, make_manifest


def engine_state(engine) -> dict[str, torch.Tensor]:
    """A copy of a built-in engine's parameters (the weights a sync from it would carry)."""
    return {n: p.detach().clone() for n, p in engine._params.items()}


def packed_sync(
    state: dict[str, torch.Tensor],
    *,
    version: int = 1,
    sync_id: str = "s1",
    bucket_bytes: int = 64 << 10,
    owners: list[int] | None = None,
) -> tuple[Manifest, list[torch.Tensor]]:
    """(manifest of `state`'s tensors, one packed buffer per bucket in the manifest's order)."""
    metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    m = make_manifest(
        metas, version=version, sync_id=sync_id, bucket_bytes=bucket_bytes, checksum_algo=ALGO, owners=owners
    )
    bufs = []
    for b in m.buckets:
        buf = alloc_buffer(b.nbytes)
        pack_bucket(b, [(s.meta.name, state[s.meta.name]) for s in b.slots], buf)
        bufs.append(buf)
    return m, bufs
