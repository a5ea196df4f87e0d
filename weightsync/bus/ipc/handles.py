"""CUDA IPC for a trainer and an engine on the same GPU: share bucket buffers by handle.

The handle is the fields of `UntypedStorage._share_cuda_()` carried in a protobuf message
(CudaIpcHandle) — nothing is pickled. The receiver maps the storage, consumes the bucket in
place and drops the mapping; the sender reuses the buffer only after that acknowledgement (the gRPC
PushBucket reply). Device indices differ between processes with different CUDA_VISIBLE_DEVICES,
so the handle names the GPU by UUID and the receiver maps it back to its own index.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from weightsync.bus.gpu import device_uuid, local_index_of
from weightsync.bus.plan import BucketPlan
from weightsync.v1 import bus_pb2


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


class HandleCache:
    """Share each reusable bucket buffer once per sync, not once per bucket.

    The pipeline packs every regular bucket into one of two long-lived buffers, so their handles
    are made once and pushed again for later buckets; the cache holds the buffers, so the memory a
    handle names cannot be freed and handed to another tensor while the handle is in use. A buffer
    that is not reused (an oversized tensor sent from its own memory) is shared on its own, and
    copied first when it does not start its storage (a handle names a whole allocation).
    Freshness of the bytes is the sender's job: it synchronises its stream before each push.
    """

    def __init__(self, share_fn: Callable[[torch.Tensor], bus_pb2.CudaIpcHandle] = share):
        self._share = share_fn
        self._cached: dict[int, tuple[torch.Tensor, bus_pb2.CudaIpcHandle]] = {}
        self.shares = 0

    def handle(self, buf: torch.Tensor, reusable: bool) -> tuple[bus_pb2.CudaIpcHandle, torch.Tensor]:
        """(handle, tensor the caller keeps alive until the receiver has acknowledged the bucket)."""
        if not reusable:
            own = buf if buf.storage_offset() == 0 else buf.clone()
            self.shares += 1
            return self._share(own), own
        key = buf.untyped_storage().data_ptr()
        hit = self._cached.get(key)
        if hit is None:
            if buf.storage_offset() != 0:
                raise ValueError("a reusable bucket buffer must start its storage (share the buffer, not a view into it)")
            hit = (buf, self._share(buf))
            self.shares += 1
            self._cached[key] = hit
        return hit[1], hit[0]

    def clear(self) -> None:
        self._cached.clear()


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
