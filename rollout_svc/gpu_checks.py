"""Which GPU transports this rollout can serve: nccl needs a CUDA engine, ipc the trainer's own GPU.

Checked in PrepareSync, before anything is prepared, so a rollout that cannot take part says why
at once instead of timing out a whole NCCL group or failing on the first bucket.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from rollout_svc.transaction import SyncError
from weightsync.v1 import bus_pb2


def engine_device(engine) -> torch.device | None:
    """The GPU (or CPU) this process receives bus buckets on for the engine, if known.

    The built-in engine says `device`; SGLang runs in this process's CUDA context from
    `base_gpu_id` (its first TP rank's GPU), where the buckets are handed over with load_bucket.
    """
    dev = getattr(engine, "device", None)
    if dev is not None:
        return torch.device(dev)
    gpu = getattr(getattr(engine, "opts", None), "base_gpu_id", None)
    return torch.device("cuda", int(gpu)) if gpu is not None else None


def require_cuda(device: torch.device | None, transport: str, engine_name: str) -> torch.device:
    if device is None or device.type != "cuda":
        where = f"on {device}" if device is not None else "without a device this rollout can receive into"
        raise SyncError(f"transport {transport} needs a CUDA engine, and this rollout's {engine_name} engine runs "
                        f"{where}: start it with --device cuda:N, or sync it with --transport tcp",
                        "FAILED_PRECONDITION")
    return device


def gpu_uuid(device: torch.device | None) -> str:
    """The UUID of the GPU this rollout receives on, "" when it is not a GPU."""
    from weightsync.bus.cuda_ipc import uuid_of  # lazy: CUDA only

    return uuid_of(device)


def check_ipc(spec: bus_pb2.IpcTransport, device: torch.device | None, engine_name: str,
              uuid_of: Callable[[torch.device], str] = gpu_uuid) -> str:
    """This engine's GPU UUID if it is the trainer's GPU (`spec.device_uuid`); otherwise SyncError."""
    dev = require_cuda(device, "ipc", engine_name)
    if not spec.device_uuid:
        raise SyncError("transport.ipc.device_uuid is empty: the trainer must name the GPU its buffers live on",
                        "INVALID_ARGUMENT")
    own = uuid_of(dev)
    if own != spec.device_uuid:
        raise SyncError(f"transport ipc: the trainer's buffers are on GPU {spec.device_uuid}, this rollout's engine "
                        f"is on {own} ({dev}); CUDA IPC needs both on one GPU: colocate them or use --transport nccl",
                        "FAILED_PRECONDITION")
    return own
