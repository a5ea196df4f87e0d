"""A stand-in for libnccl over gloo, with the interface of weightsync.bus.nccl.group.CudaNcclBus.

CI has no GPU, yet the NCCL paths that span processes — a multi-sender sync in which several
trainer ranks each build a group with every rollout process — need real processes to be tested.
This bus gives them the same shape on CPU: `new_unique_id` starts a TCPStore in the calling
process (as ncclGetUniqueId starts NCCL's bootstrap root there) and returns its address; every
rank's `open_group` rendezvous there and builds a gloo group (blocking until the whole world has
joined, or timing out, as ncclCommInitRank); a bucket is a gloo broadcast from rank 0.
Selected with the debug switch nccl_bus=tests.support.gloo_nccl:GlooNcclBus (weightsync/debug.py;
env WS_TRAINER_NCCL_BUS / WS_ROLLOUT_NCCL_BUS for the services), in processes that have the
repository root on their path (tests only: loopback addresses, no authentication beyond the
services' own). Real NCCL is exercised by tests/gpu.

A test that must act while a sender is mid-stream (kill it, say) holds that sender instead of racing
it: with WS_GLOO_HOLD=<path> and WS_GLOO_HOLD_RANK=<global rank> in the services' environment, the
sender of that trainer rank waits before each bucket while <path> exists, and says so by creating
<path>.held (the test waits for that file, then acts; removing <path> lets the stream go on).
RANK unset (a single-process trainer) is rank 0. WS_GLOO_HOLD_AT=<n> holds only from the n-th bucket
of each stream on (n-1 buckets went through first: the hold lands mid-stream by construction).
WS_GLOO_PACE_BPS=<bytes per second> paces every bucket a trainer process sends, as a slow link
would, so that a normal stream lasts long against the liveness timeout whatever the box's speed. Each
bucket on its own: a send ends no earlier than its bytes would have crossed such a link from the send's
start, so no bucket goes faster than the link, also after one that waited for a late receiver.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from weightsync.bus.channel import BucketReceiver, BucketSender
from weightsync.bus.errors import TransportError

_HOST = "127.0.0.1"
_ID_BYTES = 128
#: aborted gloo groups, never destroyed (see GlooGroup.abort)
_ABORTED: list = []
_POLL_S = 0.001  # a broadcast's completion is polled this often (an abort ends the wait within it)
_HOLD_LIMIT_S = 300.0  # a test that forgot its hold still ends: the sync's own deadline fails it first


def _held_here() -> Path | None:
    """The hold file that gates this process's sends, when this is the held trainer rank."""
    path, rank = os.environ.get("WS_GLOO_HOLD"), os.environ.get("WS_GLOO_HOLD_RANK")
    if not path or rank is None or os.environ.get("RANK", "0") != rank:
        return None
    return Path(path)


def _wait_while_held(hold: Path) -> None:
    if not hold.exists():
        return
    Path(f"{hold}.held").touch()
    deadline = time.monotonic() + _HOLD_LIMIT_S
    while hold.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, seconds))


class GlooGroup:
    def __init__(self, pg: ProcessGroupGloo, rank: int, world_size: int, timeout: float, store):
        self.pg, self.rank, self.world_size, self.timeout = pg, rank, world_size, timeout
        self._store = store  # keeps the rendezvous client alive with the group
        self.device = torch.device("cpu")
        self.broken = ""
        self._lock = threading.Lock()

    @property
    def healthy(self) -> bool:
        return not self.broken

    def broadcast(self, buf: torch.Tensor, timeout: float | None = None) -> None:
        if self.broken:
            raise TransportError(f"NCCL group unusable: {self.broken}")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        deadline = time.monotonic() + (timeout or self.timeout)
        try:
            work = self.pg.broadcast([buf], opts)
            # polled, as NcclGroup.wait polls its event: an abort from another thread ends this wait at
            # once, as ncclCommAbort does (gloo's own abort leaves a posted operation to its timeout)
            while not work.is_completed():
                if self.broken:
                    raise TransportError(f"NCCL broadcast failed: {self.broken}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"broadcast of {buf.numel()} bytes exceeded its timeout")
                time.sleep(_POLL_S)
            work.wait(_td(max(0.001, deadline - time.monotonic())))
        except TransportError:
            raise
        except Exception as exc:  # gloo: a peer gone or the wait timed out; the group is done for
            self.abort(f"broadcast of {buf.numel()} bytes failed: {exc}")
            raise TransportError(f"NCCL broadcast failed: {self.broken}") from None
        if self.broken:
            raise TransportError(f"NCCL broadcast failed: {self.broken}")

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.broken:
                return
            self.broken = reason
        # gloo's destructor waits for the operations still posted on the group (to gloo's own timeout,
        # the group's): dropped in a request's thread it would hold that thread, and the GIL, that long.
        # An aborted NCCL communicator costs nothing to drop, so the stand-in keeps aborted groups alive.
        _ABORTED.append(self.pg)
        try:
            self.pg.abort()  # this rank's own posted operations are left to gloo's timeout; `broadcast` stops waiting
        except Exception:  # noqa: BLE001 — aborting an already failed group: nothing left to stop
            pass

    def close(self) -> None:
        self.abort("closed")


class GlooSender(BucketSender):
    checksums_in_band = "none"  # as NCCL's: the receivers checksum what arrived
    collective = True  # one broadcast reaches every member

    def __init__(self, group: GlooGroup):
        if group.rank != 0:
            raise ValueError("the bus sender must be rank 0 of its NCCL group")
        self.group = group
        self._hold = _held_here()
        self._hold_at = int(os.environ.get("WS_GLOO_HOLD_AT", "1"))
        self._pace = float(os.environ.get("WS_GLOO_PACE_BPS", "0"))
        self._sent = 0

    def send(self, plan, buf: torch.Tensor, checksum) -> None:
        self._sent += 1
        if self._hold is not None and self._sent >= self._hold_at:
            _wait_while_held(self._hold)
        t0 = time.monotonic()
        self.group.broadcast(buf[: plan.nbytes].cpu().contiguous())
        if self._pace > 0:  # as a link of that rate: the send ends once its bytes would have crossed it
            time.sleep(max(0.0, t0 + plan.nbytes / self._pace - time.monotonic()))

    def framed(self):
        from weightsync.bus.nccl.framed import FramedSender

        return FramedSender(self.group)


class GlooReceiver(BucketReceiver):
    def __init__(self, group: GlooGroup, buckets):
        self.group = group

    def recv(self, plan, timeout: float):
        buf = torch.empty(plan.nbytes, dtype=torch.uint8)
        self.group.broadcast(buf, timeout)
        return buf, None


class GlooNcclBus:
    needs_cuda = False

    def __init__(self):
        self._stores: list = []  # rendezvous servers made here live as long as the bus

    def new_unique_id(self) -> bytes:
        store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False, timeout=_td(600))
        self._stores.append(store)
        addr = f"{_HOST}:{store.port}".encode()
        return addr + b"\0" * (_ID_BYTES - len(addr))

    def open_group(self, unique_id: bytes, world_size: int, rank: int, device, timeout: float) -> GlooGroup:
        host, _, port = unique_id.rstrip(b"\0").decode().partition(":")
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=_td(timeout))
            opts = ProcessGroupGloo._Options()
            opts._timeout = _td(timeout)
            opts._devices = [ProcessGroupGloo.create_device(hostname=_HOST)]
            pg = ProcessGroupGloo(store, rank, world_size, opts)
        except Exception as exc:
            raise TransportError(f"NCCL group init (rank {rank} of {world_size}) failed: {exc}") from None
        return GlooGroup(pg, rank, world_size, timeout, store)

    def sender(self, group: GlooGroup) -> GlooSender:
        return GlooSender(group)

    def receiver(self, group: GlooGroup, buckets) -> GlooReceiver:
        return GlooReceiver(group, buckets)
