"""The NCCL channel: one broadcast per whole flat bucket from the trainer (rank 0) to every engine rank.

A group is trainer rank 0 + every receiving engine rank; it is built once from a unique id that
travels over gRPC (NcclTransport) and reused across syncs while membership is unchanged. Every
collective is enqueued on the group's own CUDA stream and then polled against a deadline; on
timeout or an asynchronous NCCL error the communicator is aborted (so no rank hangs forever)
and the group must be rebuilt.
"""

from __future__ import annotations

import threading
import time

import torch

from weightsync.bus.channel import BucketReceiver, BucketSender
from weightsync.bus.errors import TransportError
from weightsync.bus.nccl import libnccl
from weightsync.bus.plan import BucketPlan

# Poll without sleeping (sleep(0) still releases the GIL to the packing thread): a sleeping
# poll adds up to its period between buckets, which on NVLink is ~10% of the transfer time.
_POLL_S = 0.0


class NcclGroup:
    def __init__(self, unique_id: bytes, world_size: int, rank: int, device: torch.device | str, timeout: float = 60.0):
        self.world_size, self.rank, self.timeout = world_size, rank, timeout
        self.device = torch.device(device)
        self.comm = None
        self.broken = ""
        # Another thread may abort the group (an AbortSync, a superseding prepare) while the owner
        # polls it: every use of `comm` holds this lock, so nobody touches a freed communicator.
        self._lock = threading.Lock()
        box: dict = {}

        def init() -> None:
            try:
                with torch.cuda.device(self.device):
                    box["comm"] = libnccl.comm_init_rank(world_size, unique_id, rank)
            except Exception as exc:  # reported by the waiting thread
                box["error"] = exc

        # ncclCommInitRank blocks until every rank joins; a missing peer must not hang the caller.
        t = threading.Thread(target=init, name=f"nccl-init-r{rank}", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            self.broken = f"NCCL group init (rank {rank} of {world_size}) did not complete within {timeout:.0f}s"
            raise TransportError(self.broken)
        if "error" in box:
            raise TransportError(f"NCCL group init failed: {box['error']}")
        self.comm = box["comm"]
        self.stream = torch.cuda.Stream(device=self.device)

    @property
    def healthy(self) -> bool:
        return self.comm is not None and not self.broken

    def enqueue(self, buf: torch.Tensor, after_current: bool = True) -> torch.cuda.Event:
        """Enqueue a broadcast of `buf` from rank 0 on the group's stream; returns its completion event.

        `after_current` orders it after work already queued on the caller's stream (e.g. the
        copies out of this buffer's previous contents).
        """
        if buf.device != self.device or buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise ValueError(
                f"broadcast wants a contiguous uint8 buffer on {self.device}, got {buf.dtype} on {buf.device}"
            )
        with self._lock:
            if self.broken or self.comm is None:
                raise TransportError(f"NCCL group unusable: {self.broken or 'closed'}")
            if after_current:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                libnccl.broadcast(self.comm, buf.data_ptr(), buf.numel(), 0, self.stream.cuda_stream)
                done = torch.cuda.Event()
                done.record(self.stream)
        buf.record_stream(self.stream)
        return done

    def wait(self, done: torch.cuda.Event, nbytes: int, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.timeout)
        while not done.query():
            with self._lock:
                err = libnccl.async_error(self.comm) if self.comm is not None else 0
            if self.broken or err != 0 or time.monotonic() > deadline:
                self.abort(f"NCCL error {err}" if err else f"broadcast of {nbytes} bytes exceeded its timeout")
                raise TransportError(f"NCCL broadcast failed: {self.broken}")
            time.sleep(_POLL_S)
        # An abort makes NCCL's kernels exit, which completes the event without the data.
        if self.broken:
            raise TransportError(f"NCCL broadcast failed: {self.broken}")

    def broadcast(self, buf: torch.Tensor, timeout: float | None = None, after_current: bool = True) -> None:
        """Broadcast `buf` from rank 0 and return once it is complete on this rank."""
        self.wait(self.enqueue(buf, after_current), buf.numel(), timeout)

    def abort(self, reason: str) -> None:
        """Make the communicator unusable at once, from any thread; idempotent (the first reason stays)."""
        with self._lock:
            self.broken = self.broken or reason
            if self.comm is not None:
                libnccl.abort(self.comm)
                self.comm = None

    def close(self) -> None:
        with self._lock:
            if self.comm is not None:
                libnccl.destroy(self.comm)
                self.comm = None
            self.broken = self.broken or "closed"


class NcclBucketSender(BucketSender):
    """Trainer side; the NCCL group reaches every receiver at once, so failures are group-wide.

    Bucket k+1 is enqueued before bucket k has finished, so the wire never waits for the host;
    `send(k)` returns once bucket k-1 is done (its buffer is then reusable).
    """

    releases_previous = True
    checksums_in_band = "none"  # receivers checksum what arrived; the trainer's values go with the commit
    collective = True  # one broadcast reaches every member

    def __init__(self, group: NcclGroup):
        if group.rank != 0:
            raise ValueError("the bus sender must be rank 0 of its NCCL group")
        self.group = group
        self._inflight: list[tuple[torch.cuda.Event, int, torch.Tensor]] = []

    def send(self, plan: BucketPlan, buf: torch.Tensor, checksum: int | None) -> None:
        if buf.device != self.group.device:
            buf = buf.to(self.group.device)
        view = buf[: plan.nbytes]
        # The pipeline's packer synchronised this buffer already: don't wait on its next pack.
        self._inflight.append((self.group.enqueue(view, after_current=False), plan.nbytes, view))
        while len(self._inflight) > 1:
            done, n, _ = self._inflight.pop(0)
            self.group.wait(done, n)

    def flush(self) -> None:
        while self._inflight:
            done, n, _ = self._inflight.pop(0)
            self.group.wait(done, n)

    def failures(self) -> dict[str, str]:
        return {}

    def framed(self):
        """This group's sender of framed buckets (dense or delta: weightsync/bus/nccl/framed.py)."""
        from weightsync.bus.nccl.framed import FramedSender

        self.flush()
        return FramedSender(self.group)

    def close(self) -> None:
        self._inflight.clear()


class NcclBucketReceiver(BucketReceiver):
    """Engine side, double-buffered: bucket k+1 is already being received while the caller loads
    bucket k, so the engine's copies hide behind the wire time. `buckets` are the ones this group
    carries (one sender's, in its sending order); `recv` is called in that order."""

    def __init__(self, group: NcclGroup, buckets: list[BucketPlan]):
        self.group = group
        size = max((b.nbytes for b in buckets), default=0)
        self._bufs = [torch.empty(size, dtype=torch.uint8, device=group.device) for _ in range(min(2, len(buckets)))]
        self._plans = list(buckets)
        self._pos = {b.index: i for i, b in enumerate(self._plans)}
        self._pending: dict[int, torch.cuda.Event] = {}

    def _post(self, pos: int) -> None:
        if pos < len(self._plans) and pos not in self._pending:
            buf = self._bufs[pos % len(self._bufs)][: self._plans[pos].nbytes]
            self._pending[pos] = self.group.enqueue(buf)

    def recv(self, plan: BucketPlan, timeout: float) -> tuple[torch.Tensor, int | None]:
        pos = self._pos.get(plan.index)
        if pos is None:
            raise ValueError(f"bucket {plan.index} does not travel on this NCCL group")
        self._post(pos)
        # Bucket k+1 goes to the other buffer, ordered after the caller's copies out of it (bucket
        # k-1, already queued): posting it before waiting keeps the wire busy across buckets.
        self._post(pos + 1)
        self.group.wait(self._pending.pop(pos), plan.nbytes, timeout)
        return self._bufs[pos % len(self._bufs)][: plan.nbytes], None

    def close(self) -> None:
        pass


class CudaNcclBus:
    """The NCCL bus as the services use it: unique ids, groups, senders and receivers over libnccl.

    The services take a bus object rather than these classes directly, so that CPU tests can run
    the whole orchestration over an in-process loopback with the same interface.
    """

    needs_cuda = True

    def new_unique_id(self) -> bytes:
        return libnccl.new_unique_id()

    def open_group(
        self, unique_id: bytes, world_size: int, rank: int, device: torch.device, timeout: float
    ) -> NcclGroup:
        return NcclGroup(unique_id, world_size, rank, device, timeout=timeout)

    def sender(self, group: NcclGroup) -> NcclBucketSender:
        return NcclBucketSender(group)

    def receiver(self, group: NcclGroup, buckets: list[BucketPlan]) -> NcclBucketReceiver:
        return NcclBucketReceiver(group, buckets)


def default_bus():
    """The bus the services use when none is given: libnccl (CudaNcclBus).

    The config's `debug.nccl_bus="module:attr"` (weightsync/debug.py) names a stand-in with the same
    interface instead: the module
    is imported from the process's path and `attr` called with no arguments. It exists for the CPU
    test suite, which runs the multi-process NCCL paths (several trainer ranks, each rollout
    process) over a gloo stand-in that lives with the tests (tests.support.gloo_nccl:GlooNcclBus);
    the product ships no stand-in and imports no test code unless this names it. A service logs
    loudly when it is set.
    """
    import importlib
    import logging

    from weightsync.debug import switches

    name = switches().nccl_bus
    if not name:
        return CudaNcclBus()
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"debug.nccl_bus={name!r} must be module:attr (a stand-in bus for tests), or empty")
    logging.getLogger(__name__).warning("NCCL bus replaced by %s (debug.nccl_bus): for tests only", name)
    return getattr(importlib.import_module(module), attr)()
