"""The rollout's end of NCCL: one cached communicator and the receive thread of a sync.

PrepareSync (the NcclTransport message) says which group to use: `new_group` builds a communicator from the
trainer's unique id (dropping any older one), otherwise the rollout must still hold `group_id`,
or it refuses, so a restarted rollout makes the trainer rebuild instead of hanging everyone.
The join and the receive run in a thread started after the transaction is prepared (the trainer
joins only once every prepare has answered); the thread feeds `SyncTransaction.run_receiver`.

A communicator is kept only if its sync received every bucket: a sync that ends early (abort,
error, timeout) may leave receives posted on it, so it is aborted and the next sync rebuilds.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightsync.bus.errors import SyncError
from weightsync.bus.gpu import require_cuda, uuid_of
from weightsync.bus.nccl.libnccl import UNIQUE_ID_BYTES
from weightsync.bus.plan import Manifest
from weightsync.v1 import bus_pb2

log = logging.getLogger(__name__)

_MAX_WORLD = 1 << 16
_MAX_GROUP_ID = 128
_MAX_TIMEOUT_S = 7 * 24 * 3600.0
_SETTLE_S = 5.0


class _CountingReceiver:
    """The bus receiver of one sync; aborts the communicator if the sync ends before its last bucket."""

    def __init__(self, inner, group, num_buckets: int):
        self.inner, self.group, self.num_buckets = inner, group, num_buckets
        self.received = 0

    @property
    def complete(self) -> bool:
        return self.received >= self.num_buckets

    def recv(self, plan, timeout: float):
        out = self.inner.recv(plan, timeout)
        self.received += 1
        return out

    def close(self) -> None:
        self.inner.close()
        if not self.complete:
            self.group.abort(f"sync ended after {self.received}/{self.num_buckets} buckets")


@dataclass
class _Receive:
    sync_id: str
    group: object = None
    rx: _CountingReceiver | None = None
    thread: threading.Thread | None = None
    cancelled: str = ""


class NcclReceiver:
    def __init__(self, tx, device: torch.device | None, engine_name: str, bus=None,
                 on_build: Callable[[], None] | None = None):
        self.tx, self.device, self.engine_name = tx, device, engine_name
        self._bus = bus
        self._on_build = on_build or (lambda: None)
        self.uuid_of: Callable[[torch.device | None], str] = uuid_of  # tests name GPUs the loopback lacks
        self._lock = threading.Lock()
        self._group = None
        self._group_key: tuple[str, int, int] | None = None  # (group_id, world_size, rank)
        self._active: _Receive | None = None
        self.builds = 0

    @property
    def bus(self):
        if self._bus is None:
            from weightsync.bus.nccl.group import CudaNcclBus  # lazy: libnccl only when used

            self._bus = CudaNcclBus()
        return self._bus

    @property
    def group_id(self) -> str:
        return self._group_key[0] if self._group_key else ""

    def device_uuid(self) -> str:
        return self.uuid_of(self.device)

    # ---- PrepareSync ----------------------------------------------------------------------
    def check(self, spec: bus_pb2.NcclTransport) -> None:
        """Refuse, before anything is prepared, a sync this rollout cannot join."""
        if getattr(self._bus, "needs_cuda", True):
            require_cuda(self.device, "nccl", self.engine_name)
        if len(spec.unique_id) != UNIQUE_ID_BYTES:
            raise SyncError(f"transport.nccl.unique_id has {len(spec.unique_id)} bytes, an ncclUniqueId has "
                            f"{UNIQUE_ID_BYTES}", "INVALID_ARGUMENT")
        if not 2 <= spec.world_size <= _MAX_WORLD:
            raise SyncError(f"transport.nccl.world_size={spec.world_size} must be in [2, {_MAX_WORLD}] "
                            "(the trainer plus every receiving rank)", "INVALID_ARGUMENT")
        if not 1 <= spec.rank_offset < spec.world_size:
            raise SyncError(f"transport.nccl.rank_offset={spec.rank_offset} must be in [1, world_size="
                            f"{spec.world_size}) (rank 0 is the trainer)", "INVALID_ARGUMENT")
        if not 0 < len(spec.group_id) <= _MAX_GROUP_ID:
            raise SyncError(f"transport.nccl.group_id must have 1..{_MAX_GROUP_ID} characters", "INVALID_ARGUMENT")
        t = spec.timeout_seconds
        if not (math.isfinite(t) and 0 <= t <= _MAX_TIMEOUT_S):
            raise SyncError(f"transport.nccl.timeout_seconds={t} must be finite and in [0, {_MAX_TIMEOUT_S:.0f}]",
                            "INVALID_ARGUMENT")
        if spec.new_group:
            return
        self._settle()
        with self._lock:
            held = self._group is not None and getattr(self._group, "healthy", True) \
                and self._group_key == (spec.group_id, spec.world_size, spec.rank_offset) \
                and (self._active is None or (self._active.rx is not None and self._active.rx.complete))
            if not held:
                raise SyncError(f"nccl group {spec.group_id} (rank {spec.rank_offset} of {spec.world_size}) is not held "
                                f"here (this rollout holds {self.group_id or 'none'}; restarted, or its last sync "
                                "failed): the trainer must build a new group", "FAILED_PRECONDITION")

    def start(self, manifest: Manifest, spec: bus_pb2.NcclTransport, deadline: float) -> None:
        """Join (or reuse) the group and receive every bucket of the prepared `manifest`, in a thread."""
        with self._lock:
            self._cancel_locked(f"superseded by sync {manifest.sync_id}")
            if spec.new_group:
                self._drop_group_locked(f"replaced by group {spec.group_id}")
            job = _Receive(manifest.sync_id, group=None if spec.new_group else self._group)
            job.thread = threading.Thread(target=self._receive, args=(job, manifest, spec, deadline),
                                          name=f"nccl-recv-{manifest.sync_id}", daemon=True)
            self._active = job
        job.thread.start()

    def _receive(self, job: _Receive, manifest: Manifest, spec: bus_pb2.NcclTransport, deadline: float) -> None:
        try:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            if spec.new_group:
                left = deadline - time.monotonic()
                group = self.bus.open_group(spec.unique_id, spec.world_size, spec.rank_offset, self.device,
                                            min(spec.timeout_seconds or left, left))
                with self._lock:
                    if job.cancelled:
                        group.abort(job.cancelled)
                        raise SyncError(f"sync aborted while joining the group ({job.cancelled})")
                    self._group, self._group_key = group, (spec.group_id, spec.world_size, spec.rank_offset)
                    job.group = group
                    self.builds += 1
                self._on_build()
                log.info("joined NCCL group %s as rank %d of %d", spec.group_id, spec.rank_offset, spec.world_size)
            group = job.group
            group.timeout = max(0.001, deadline - time.monotonic())
            rx = _CountingReceiver(self.bus.receiver(group, manifest.buckets), group, len(manifest.buckets))
            with self._lock:
                if job.cancelled:
                    raise SyncError(f"sync aborted before receiving ({job.cancelled})")
                job.rx = rx
        except Exception as exc:
            log.error("sync %s: NCCL receive not started: %s", manifest.sync_id, exc)
            self.tx.abort(manifest.sync_id, f"nccl group {spec.group_id}: {exc}")
            with self._lock:
                if job.group is not None:  # it may have receives posted by now; a newer sync's group is not ours
                    job.group.abort(f"sync {manifest.sync_id} failed to start receiving")
                    if job.group is self._group:
                        self._group, self._group_key = None, None
            return
        self.tx.run_receiver(manifest.sync_id, rx)

    # ---- AbortSync / shutdown -------------------------------------------------------------
    def abort(self, sync_id: str, reason: str) -> None:
        """The sync is over without a commit: stop its receive (aborting the group if it is mid-stream)."""
        with self._lock:
            if self._active is not None and self._active.sync_id == sync_id:
                self._cancel_locked(reason)

    def cancel_active(self, reason: str) -> None:
        with self._lock:
            self._cancel_locked(reason)

    def close(self) -> None:
        with self._lock:
            self._cancel_locked("rollout shutting down")
            self._drop_group_locked("rollout shutting down")

    def _cancel_locked(self, reason: str) -> None:
        job = self._active
        if job is None or job.cancelled:
            return
        job.cancelled = reason
        if job.rx is not None and job.rx.complete:
            return  # every bucket arrived: nothing is posted on the group, keep it
        if job.group is not None:
            job.group.abort(reason)  # wakes the receive thread's wait at once
            if job.group is self._group:
                self._group, self._group_key = None, None

    def _drop_group_locked(self, reason: str) -> None:
        if self._group is not None:
            self._group.abort(reason)
        self._group, self._group_key = None, None

    def _settle(self) -> None:
        """Let the previous sync's thread finish its last bucket before judging whether the group is reusable."""
        job = self._active
        if job is not None and job.thread is not None and job.rx is not None and job.rx.complete:
            job.thread.join(_SETTLE_S)
