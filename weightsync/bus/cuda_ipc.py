"""CUDA IPC for a trainer and an engine on the same GPU: share bucket buffers by handle.

The handle is the fields of `UntypedStorage._share_cuda_()` carried in a protobuf message
(CudaIpcHandle) — nothing is pickled. The receiver maps the storage, copies the bucket out and
drops the mapping; the sender reuses the buffer only after that acknowledgement (the gRPC
PushBucket reply). Device indices differ between processes with different CUDA_VISIBLE_DEVICES,
so the handle names the GPU by UUID and the receiver maps it back to its own index.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from weightsync.bus.plan import BucketPlan
from weightsync.v1 import bus_pb2


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index_of(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise ValueError(f"CUDA IPC handle names GPU {uuid}, which this process cannot see "
                     "(trainer and engine must share the GPU; check CUDA_VISIBLE_DEVICES)")


def share(buf: torch.Tensor) -> bus_pb2.CudaIpcHandle:
    if buf.device.type != "cuda":
        raise ValueError("only CUDA buffers can be shared by IPC handle")
    if buf.storage_offset() != 0:
        raise ValueError("share whole bucket buffers (storage offset 0), not views into them")
    storage = buf.untyped_storage()
    # `offset` is where this storage sits inside the allocator's cudaMalloc block.
    (dev, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return bus_pb2.CudaIpcHandle(device=dev, handle=handle, storage_size=size, storage_offset=offset,
                                 ref_counter_handle=ref_handle, ref_counter_offset=ref_offset,
                                 event_handle=event_handle or b"", event_sync_required=event_sync,
                                 device_uuid=device_uuid(dev))


@contextlib.contextmanager
def mapped_ipc_bucket(h: bus_pb2.CudaIpcHandle, nbytes: int) -> Iterator[torch.Tensor]:
    """Map the sender's buffer for the duration of the block (no copy); consume it inside."""
    dev = local_index_of(h.device_uuid) if h.device_uuid else h.device
    if nbytes > h.storage_size:
        raise ValueError(f"IPC bucket of {h.storage_size} bytes cannot hold the {nbytes} bytes the manifest declares")
    storage = torch.UntypedStorage._new_shared_cuda(dev, h.handle, h.storage_size, h.storage_offset,
                                                    h.ref_counter_handle, h.ref_counter_offset,
                                                    h.event_handle or None, h.event_sync_required)
    mapped = torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(storage)
    try:
        yield mapped[:nbytes]
        torch.cuda.current_stream(dev).synchronize()  # the sender may overwrite the buffer after we return
    finally:
        del mapped, storage


def open_ipc_bucket(h: bus_pb2.CudaIpcHandle, nbytes: int | None = None) -> torch.Tensor:
    """Map the sender's buffer and return a private copy of its first `nbytes` bytes."""
    dev = local_index_of(h.device_uuid) if h.device_uuid else h.device
    storage = torch.UntypedStorage._new_shared_cuda(dev, h.handle, h.storage_size, h.storage_offset, h.ref_counter_handle,
                                                    h.ref_counter_offset, h.event_handle or None,
                                                    h.event_sync_required)
    mapped = torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(storage)
    n = h.storage_size if nbytes is None else nbytes
    if n > h.storage_size:
        raise ValueError(f"IPC bucket of {h.storage_size} bytes cannot hold the {n} bytes the manifest declares")
    out = mapped[:n].clone()
    torch.cuda.current_stream(dev).synchronize()
    del mapped, storage
    return out


class IpcBucketSender:
    """Trainer side: hands each bucket's handle to `push` and returns once the engine has copied it."""

    def __init__(self, push: Callable[[BucketPlan, bus_pb2.CudaIpcHandle, int | None], None]):
        self.push = push

    def send(self, plan: BucketPlan, buf: torch.Tensor, checksum: int | None) -> None:
        torch.cuda.current_stream(buf.device).synchronize()
        self.push(plan, share(buf), checksum)

    def failures(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass
