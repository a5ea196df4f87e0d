"""The rollout's end of CUDA IPC: check the trainer's GPU at prepare, consume pushed handles in place.

PrepareSync names the trainer's GPU by UUID; this rollout takes part only if its engine is on
that GPU. Each PushBucket then carries one bucket's CUDA IPC handle: the buffer is mapped,
consumed by the sync transaction while mapped (no extra copy) and unmapped before the reply,
which is what lets the trainer reuse it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from weightsync.bus.errors import SyncError
from weightsync.bus.gpu import require_cuda, uuid_of
from weightsync.v1 import bus_pb2, rollout_pb2


def check_ipc(spec: bus_pb2.IpcTransport, device: torch.device | None, engine_name: str,
              uuid_of: Callable[[torch.device], str] = uuid_of) -> str:
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


class IpcReceiver:
    """Remembers which sync was prepared for CUDA IPC (and on which GPU) and feeds its pushed buckets."""

    def __init__(self, tx, device: torch.device | None, engine_name: str):
        self.tx, self.device, self.engine_name = tx, device, engine_name
        self._sync: tuple[str, str] = ("", "")  # (sync_id, GPU UUID) of the sync prepared for CUDA IPC

    def check(self, spec: bus_pb2.IpcTransport) -> str:
        """PrepareSync: this engine's GPU UUID, or SyncError when it is not the trainer's GPU."""
        return check_ipc(spec, self.device, self.engine_name)

    def start(self, sync_id: str, gpu: str) -> None:
        """The sync is prepared: accept its pushes (replacing any earlier IPC sync)."""
        self._sync = (sync_id, gpu)

    def push(self, request: rollout_pb2.PushBucketRequest) -> None:
        """Consume one pushed bucket of the prepared sync; SyncError for anything it cannot be."""
        manifest = self.tx.pending_manifest(request.sync_id)
        if manifest is None:
            raise SyncError(f"sync {request.sync_id} is not prepared here")
        if not request.HasField("ipc"):
            raise SyncError("PushBucket carries CUDA IPC handles only; use the TCP bus for bytes", "INVALID_ARGUMENT")
        if request.index >= len(manifest.buckets):
            raise SyncError(f"index={request.index}: the manifest has {len(manifest.buckets)} buckets",
                            "INVALID_ARGUMENT")
        ipc_sync, gpu = self._sync
        if ipc_sync != request.sync_id or request.ipc.device_uuid != gpu:
            raise SyncError(f"ipc.device_uuid={request.ipc.device_uuid!r}: sync {request.sync_id} was not prepared "
                            f"for CUDA IPC on this engine's GPU ({gpu if ipc_sync == request.sync_id else 'not an ipc sync'})",
                            "INVALID_ARGUMENT")
        from weightsync.bus.ipc.handles import mapped_ipc_bucket  # lazy: maps CUDA memory

        # Consumed while mapped (no extra copy); the sender reuses the buffer after we reply.
        with mapped_ipc_bucket(request.ipc, manifest.buckets[request.index].nbytes) as buf:
            self.tx.consume_bucket(request.sync_id, request.index, buf, request.checksum or None)
