"""One fake GPU for CUDA IPC through the real services on a CPU: only the GPU boundary is replaced.

A share records a tensor's storage under a made-up handle and an open returns that storage (the same
memory, as a real mapping would be); every handle names the one GPU, GPU."""

from __future__ import annotations

import torch

from weightsync.bus.ipc.handles import HandleCache, MappedBuffers
from weightsync.v1 import bus_pb2

GPU = "GPU-fake-0"


class FakeGpu:
    """Shared memory of one 'GPU': handles name tensors of this process."""

    def __init__(self):
        self.memory: dict[bytes, torch.Tensor] = {}
        self.shares = self.opens = 0

    def share(self, t: torch.Tensor) -> bus_pb2.CudaIpcHandle:
        storage = t.untyped_storage()
        key = f"h{storage.data_ptr()}".encode()
        self.memory[key] = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.shares += 1
        return bus_pb2.CudaIpcHandle(handle=key, storage_size=storage.nbytes(), device_uuid=GPU)

    def open(self, h: bus_pb2.CudaIpcHandle) -> torch.Tensor:
        self.opens += 1
        return self.memory[bytes(h.handle)]


def fake_gpu_boundary(trainer, app, gpu: FakeGpu) -> None:
    """The trainer's and the rollout's CUDA IPC calls go to `gpu`, in both directions of a sync."""
    ipc = trainer.orch.transports["ipc"]
    ipc.needs_cuda, ipc.uuid_of, ipc.open_fn = False, (lambda d: GPU), gpu.open
    ipc.cache = HandleCache(gpu.share)  # (rollout_reads syncs share the trainer's buffers)
    app.servicer.ipc.check = lambda spec: GPU if spec.device_uuid == GPU else "GPU-other"
    app.servicer.ipc.share_fn = gpu.share
    app.servicer.ipc.maps = MappedBuffers(gpu.open)
