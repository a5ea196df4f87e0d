"""Which GPU a process exports or receives on, named so that another process can compare it.

A CUDA index means different GPUs in processes with different CUDA_VISIBLE_DEVICES, so the GPU
transports name GPUs by UUID. The rollout checks in PrepareSync, before anything is prepared,
that it can take part (nccl needs a CUDA engine, ipc the trainer's own GPU), so a rollout that
cannot says why at once instead of timing out a whole NCCL group or failing on the first bucket.
"""

from __future__ import annotations

import functools

import torch

from weightsync.bus.errors import SyncError


@functools.lru_cache(maxsize=None)
def device_uuid(index: int) -> str:
    # asked at every IPC/NCCL prepare on both sides; a device's UUID does not change in a process
    return str(torch.cuda.get_device_properties(index).uuid)


def uuid_of(device: torch.device | None) -> str:
    """The UUID of a CUDA device; "" for anything else, which no GPU check can match."""
    if device is None or device.type != "cuda":
        return ""
    return device_uuid(device.index if device.index is not None else torch.cuda.current_device())


def local_index_of(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise ValueError(
        f"CUDA IPC handle names GPU {uuid}, which this process cannot see "
        "(trainer and engine must share the GPU; check CUDA_VISIBLE_DEVICES)"
    )


def require_cuda(device: torch.device | None, transport: str, engine_name: str) -> torch.device:
    if device is None or device.type != "cuda":
        where = f"on {device}" if device is not None else "without a device this rollout can receive into"
        raise SyncError(
            f"transport {transport} needs a CUDA engine, and this rollout's {engine_name} engine runs "
            f"{where}: start it with --device cuda:N, or sync it with --transport tcp",
            "FAILED_PRECONDITION",
        )
    return device
