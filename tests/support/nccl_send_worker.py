"""A process standing in for one sending trainer rank over real NCCL (tests/gpu/test_nccl_multisender_gpu.py).

It joins its own group as rank 0 once, then for every "go" streams the buckets the manifest
assigns it from its GPU and answers with their checksums and its seconds; "stop" ends it.
"""

from __future__ import annotations

import time
from dataclasses import replace


def run(unique_id: bytes, world_size: int, sender: int, device: str, tensors, jobs, results) -> None:
    import torch

    from weightsync.bus.nccl.group import CudaNcclBus
    from weightsync.bus.pipeline import stream_buckets

    torch.cuda.set_device(torch.device(device))
    gpu = [(n, t.to(device)) for n, t in tensors]
    bus = CudaNcclBus()
    group = bus.open_group(unique_id, world_size, 0, torch.device(device), 120.0)
    results.put(("joined", sender))
    while True:
        job = jobs.get(timeout=600)
        if job == "stop":
            group.close()
            return
        manifest = job
        mine = manifest.buckets_of(sender)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            stats = stream_buckets(
                replace(manifest, buckets=mine),
                iter(gpu),
                bus.sender(group),
                device=torch.device(device),
                timeout=120.0,
            )
            results.put(("done", sender, {b.index: c for b, c in zip(mine, stats.checksums)}, time.perf_counter() - t0))
        except Exception as exc:  # noqa: BLE001 — reported to the test
            results.put(("error", sender, repr(exc)))


def host_unique_ids(n: int, out, stop) -> None:
    """Make `n` ncclUniqueIds here and stay alive until `stop` is set: the bootstrap root of each
    lives in this process, which joins none of the groups (as global rank 0 hosts the root of
    every other sender's group)."""
    from weightsync.bus.nccl import libnccl

    out.put([libnccl.new_unique_id() for _ in range(n)])
    stop.wait(900)
