"""CUDA IPC for a trainer and an engine on the same GPU: share bucket buffers by handle.

The handle is the fields of `UntypedStorage._share_cuda_()` carried in a protobuf message
(CudaIpcHandle) — nothing is pickled. The trainer shares each of its long-lived buffers once
(HandleCache) and the rollout maps each once and keeps the mapping from sync to sync while the
trainer is the same (MappedBuffers): opening a handle is not free, and neither is closing it.
The sender reuses a buffer only after the receiver's acknowledgement that it has copied the
bucket out. Device indices differ between processes with different CUDA_VISIBLE_DEVICES, so the
handle names the GPU by UUID and the receiver maps it back to its own index.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator

import torch

from weightsync.bus.channel import BucketSender
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
    return bus_pb2.CudaIpcHandle(
        device=dev,
        handle=handle,
        storage_size=size,
        storage_offset=offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=event_sync,
        device_uuid=device_uuid(dev),
    )


@contextlib.contextmanager
def mapped_ipc_bucket(h: bus_pb2.CudaIpcHandle, nbytes: int) -> Iterator[torch.Tensor]:
    """Map the sender's buffer for the duration of the block (no copy); consume it inside."""
    if nbytes > h.storage_size:
        raise ValueError(f"IPC bucket of {h.storage_size} bytes cannot hold the {nbytes} bytes the manifest declares")
    mapped = open_mapping(h)
    try:
        yield mapped[:nbytes]
        torch.cuda.current_stream(mapped.device).synchronize()  # the sender may overwrite the buffer after we return
    finally:
        del mapped


class HandleCache:
    """Share each long-lived buffer once for the trainer's lifetime, not once per bucket or sync.

    The pipeline packs every regular bucket into one of two buffers kept across syncs (or sends
    the actor's own bucket storage), so their handles are made once and pushed again for later
    buckets and syncs; the cache holds the buffers, so the memory a
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
                raise ValueError(
                    "a reusable bucket buffer must start its storage (share the buffer, not a view into it)"
                )
            hit = (buf, self._share(buf))
            self.shares += 1
            self._cached[key] = hit
        return hit[1], hit[0]

    def retain(self, buffers: list[torch.Tensor]) -> None:
        """Forget the buffers not in `buffers` (a pool that reallocated): their memory may go."""
        keep = {b.untyped_storage().data_ptr() for b in buffers}
        for key in [k for k in self._cached if k not in keep]:
            del self._cached[key]

    def clear(self) -> None:
        self._cached.clear()


#: (address, handle) of the mapped bucket this thread is consuming (`consuming`)
_SOURCE: contextvars.ContextVar[tuple[int, bus_pb2.CudaIpcHandle] | None] = contextvars.ContextVar(
    "ws_ipc_source", default=None
)


@contextlib.contextmanager
def consuming(buf: torch.Tensor, h: bus_pb2.CudaIpcHandle) -> Iterator[None]:
    """While the block runs, `source_handle(buf)` is `h`: an engine whose weights live in other processes
    (SGLang's TP workers) forwards the trainer's handle to them instead of copying the mapped bucket, which
    torch cannot share again."""
    token = _SOURCE.set((buf.data_ptr(), h))
    try:
        yield
    finally:
        _SOURCE.reset(token)


def source_handle(buf: torch.Tensor) -> bus_pb2.CudaIpcHandle | None:
    """The CUDA IPC handle `buf` was mapped from, if this thread is consuming it (`consuming`)."""
    cur = _SOURCE.get()
    return cur[1] if cur is not None and cur[0] == buf.data_ptr() else None


def open_mapping(h: bus_pb2.CudaIpcHandle) -> torch.Tensor:
    """Map the storage a handle names, as a flat uint8 tensor (no copy); unmapped when it is freed."""
    dev = local_index_of(h.device_uuid) if h.device_uuid else h.device
    storage = torch.UntypedStorage._new_shared_cuda(
        dev,
        h.handle,
        h.storage_size,
        h.storage_offset,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle or None,
        h.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(storage)


class MappedBuffers:
    """The rollout's open mappings of the trainer's buffers, kept across the syncs of one pairing.

    Keyed by what names the memory (GPU, IPC handle, offset and size within the allocation), so
    the same buffer pushed again — the next bucket, the next sync — is not mapped again. At the
    start of each sync (`begin`) the mappings of another trainer (a new origin) and those the last
    sync did not use are dropped: a mapping keeps the trainer's memory from being reused.
    """

    def __init__(
        self,
        open_fn: Callable[[bus_pb2.CudaIpcHandle], torch.Tensor] = open_mapping,
        on_open: Callable[[], None] | None = None,
    ):
        self._open, self._on_open = open_fn, on_open or (lambda: None)
        self._lock = threading.Lock()  # a prepare (begin) may race the stream of the sync it supersedes
        self._maps: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()
        self.owner = ""
        self.opens = 0

    def __len__(self) -> int:
        return len(self._maps)

    def begin(self, owner: str) -> None:
        with self._lock:
            if owner != self.owner:
                self._maps.clear()
                self.owner = owner
            else:
                for key in [k for k in self._maps if k not in self._used]:
                    del self._maps[key]
            self._used = set()

    def get(self, h: bus_pb2.CudaIpcHandle, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the buffer `h` names, mapped (once) into this process."""
        if nbytes > h.storage_size:
            raise ValueError(
                f"IPC bucket of {h.storage_size} bytes cannot hold the {nbytes} bytes the manifest declares"
            )
        key = (h.device_uuid, h.device, bytes(h.handle), h.storage_offset, h.storage_size)
        with self._lock:
            buf = self._maps.get(key)
            if buf is None:
                buf = self._maps[key] = self._open(h)
                self.opens += 1
                self._on_open()
            self._used.add(key)
        return buf[:nbytes]

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()
            self._used = set()


class IpcBucketSender(BucketSender):
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
