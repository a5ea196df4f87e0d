"""The trainer's end of CUDA IPC, for rollouts on the trainer's own GPU (colocated).

The trainer names its GPU by UUID in PrepareSync; a rollout whose engine is on another GPU (or
host) refuses, and the trainer double-checks the UUID the rollout answers with. Buckets are
then handed over as CUDA IPC handles in one PushBucket RPC per bucket and target: the rollout
maps the buffer, consumes the bucket in place and replies, and that reply is what lets the
pipeline reuse the buffer. Each pipeline buffer is shared once per sync (HandleCache).
"""
from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from weightsync.bus.errors import TransportError
from weightsync.bus.gpu import uuid_of as gpu_uuid
from weightsync.bus.session import RpcCall, kind_of
from weightsync.v1 import bus_pb2, rollout_pb2


def _handle_cache():
    from weightsync.bus.ipc.handles import HandleCache

    return HandleCache()


class IpcPushSender:
    """Sends each bucket to every target as a CUDA IPC handle; a target that fails is dropped, not fatal."""

    def __init__(self, targets: dict, sync_id: str, call: RpcCall, bucket_bytes: int, cache=None):
        if not targets:
            raise ValueError("IpcPushSender needs at least one target")
        self._live = dict(targets)
        self._failures: dict[str, str] = {}
        self.sync_id, self.call, self.bucket_bytes = sync_id, call, bucket_bytes
        self.cache = cache if cache is not None else _handle_cache()
        self._pool = ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="ipc-push")

    def send(self, plan, buf: torch.Tensor, checksum: int | None) -> None:
        if buf.device.type == "cuda":
            # The rollout reads the buffer through another CUDA context: every write must be done.
            torch.cuda.current_stream(buf.device).synchronize()
        # Oversized tensors travel from their own memory (see pipeline._zero_copy_candidate).
        reusable = not (len(plan.slots) == 1 and plan.nbytes > self.bucket_bytes)
        handle, keep = self.cache.handle(buf, reusable)
        req = rollout_pb2.PushBucketRequest(sync_id=self.sync_id, index=plan.index, ipc=handle,
                                            checksum=checksum or 0)
        for rid, fut in [(rid, self._pool.submit(self.call, e, "PushBucket", req)) for rid, e in self._live.items()]:
            _, err = fut.result()
            if err:
                self._failures[rid] = f"PushBucket of bucket {plan.index}: {err}"
                self._live.pop(rid)
        del keep  # acknowledged (or failed) by every target: the memory may be reused
        if not self._live:
            raise TransportError("every rollout dropped off the IPC bus: " + "; ".join(self._failures.values()))

    def failures(self) -> dict[str, str]:
        return dict(self._failures)

    def close(self) -> None:
        self.cache.clear()
        self._pool.shutdown(wait=False)


class IpcSender:
    name = "ipc"

    def __init__(self, device: torch.device, call: RpcCall, uuid_of: Callable[[torch.device], str] = gpu_uuid,
                 needs_cuda: bool = True):
        self.device = torch.device(device)
        self.call, self.uuid_of, self.needs_cuda = call, uuid_of, needs_cuda

    def begin(self, targets: list, sync_id: str, bucket_bytes: int) -> "_IpcSession":
        if self.needs_cuda and self.device.type != "cuda":
            raise ValueError(f"transport=ipc needs the trainer's export on the rollouts' GPU, and this trainer exports "
                             f"on {self.device}: run it on that GPU (backend hf: --device cuda:N) or use --transport tcp")
        return _IpcSession(self, self.uuid_of(self.device), sync_id, bucket_bytes)


class _IpcSession:
    name = "ipc"
    group_wide = False
    reused = False

    def __init__(self, owner: IpcSender, uuid: str, sync_id: str, bucket_bytes: int):
        self.owner, self.uuid, self.sync_id, self.bucket_bytes = owner, uuid, sync_id, bucket_bytes
        self.device = owner.device

    def spec_for(self, entry) -> bus_pb2.TransportSpec:
        spec = bus_pb2.TransportSpec()
        spec.ipc.host_id, spec.ipc.device_uuid = socket.gethostname(), self.uuid
        return spec

    def accept(self, entry, resp) -> str:
        if kind_of(resp) != "ipc":
            return f"rollout answered an ipc prepare with transport {kind_of(resp)}"
        theirs = resp.transport.ipc.device_uuid
        if theirs != self.uuid:
            return (f"ipc: the rollout's engine is on GPU {theirs or '(not named)'}, the trainer on {self.uuid}; "
                    "CUDA IPC needs both on one GPU: colocate them or use --transport nccl")
        return ""

    def open(self, targets: dict, timeout: float) -> IpcPushSender:
        return IpcPushSender(targets, self.sync_id, self.owner.call, self.bucket_bytes)

    def finish(self, ok: bool, reason: str) -> None:
        pass
