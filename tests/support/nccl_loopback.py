"""An in-process stand-in for libnccl with the interface of weightsync.bus.nccl.group.CudaNcclBus.

CI has no GPU, so the orchestration around NCCL (group cache, rank plan, joins that time out,
group-wide aborts) runs over this loopback: ranks rendezvous by unique id like ncclCommInitRank
(blocking until the whole world has joined, or timing out), and a broadcast from rank 0 copies
the bucket to every other rank. Real NCCL is exercised by tests/gpu. Two LoopbackBus objects
are two networks that cannot reach each other (a rank on the other one never joins).
"""

from __future__ import annotations

import os
import queue
import threading
import time

from weightsync.bus.channel import BucketSender
from weightsync.bus.errors import TransportError

_BROKEN = object()


class _Room:
    def __init__(self, world_size: int, blocking: bool = False):
        self.world_size, self.blocking = world_size, blocking
        self.joined: set[int] = set()
        self.cond = threading.Condition()
        self.queues = {r: queue.Queue() for r in range(1, world_size)}
        self.broken = ""


class LoopbackGroup:
    def __init__(self, room: _Room, rank: int, timeout: float):
        self.room, self.rank, self.timeout = room, rank, timeout
        self.broken = ""

    @property
    def healthy(self) -> bool:
        return not (self.broken or self.room.broken)

    def broadcast(self, buf, timeout: float | None = None) -> None:
        """`buf` from rank 0 into every other rank's `buf` (same size), as the plain stream's
        buckets go (the framed stream's frames: weightsync/bus/nccl/framed.py)."""
        if self.rank == 0:
            LoopbackSender(self).send(_Whole(buf.numel()), buf, None)
            return
        item, _ = LoopbackReceiver(self).recv(_Whole(buf.numel()), timeout or self.timeout)
        buf.copy_(item)

    def abort(self, reason: str) -> None:
        # An aborted rank fails the collective for everyone (real NCCL: their waits time out).
        self.broken = self.broken or reason
        with self.room.cond:
            self.room.broken = self.room.broken or f"rank {self.rank}: {reason}"
        for q in self.room.queues.values():
            q.put(_BROKEN)


class _Whole:
    """A plan of a whole buffer (a frame of the framed stream)."""

    def __init__(self, nbytes: int):
        self.index, self.nbytes = -1, nbytes


class LoopbackSender(BucketSender):
    collective = True  # one broadcast reaches every member
    releases_previous = False

    def __init__(self, group: LoopbackGroup):
        self.group = group
        self.sent = 0

    def send(self, plan, buf, checksum) -> None:
        if not self.group.healthy:
            raise TransportError(f"NCCL group unusable: {self.group.broken or self.group.room.broken}")
        queues = self.group.room.queues.values()
        for q in queues:
            q.put(buf[: plan.nbytes].clone())
        self.sent += 1
        if self.group.room.blocking:
            # as NCCL: the broadcast completes only once every rank has taken the bucket
            deadline = time.monotonic() + self.group.timeout
            while any(not q.empty() for q in queues):
                if not self.group.healthy:
                    raise TransportError(f"NCCL broadcast failed: {self.group.broken or self.group.room.broken}")
                if time.monotonic() > deadline:
                    self.group.abort(f"bucket {plan.index} not taken within {self.group.timeout:.1f}s")
                    raise TransportError(f"NCCL broadcast failed: {self.group.broken}")
                time.sleep(0.01)

    def failures(self) -> dict[str, str]:
        return {}

    def framed(self):
        from weightsync.bus.nccl.framed import FramedSender

        return FramedSender(self.group)

    def close(self) -> None:
        pass


class LoopbackReceiver:
    def __init__(self, group: LoopbackGroup):
        self.group = group

    def recv(self, plan, timeout: float):
        try:
            item = self.group.room.queues[self.group.rank].get(timeout=timeout)
        except queue.Empty:
            self.group.abort(f"bucket {plan.index} not received within {timeout:.1f}s")
            raise TransportError(f"NCCL broadcast failed: {self.group.broken}") from None
        if item is _BROKEN or not self.group.healthy:
            raise TransportError(f"NCCL broadcast failed: {self.group.broken or self.group.room.broken}")
        if item.numel() != plan.nbytes:
            raise TransportError(f"bucket {plan.index}: got {item.numel()} bytes, expected {plan.nbytes}")
        return item, None

    def close(self) -> None:
        pass


class LoopbackBus:
    needs_cuda = False

    def __init__(self, blocking_send: bool = False):
        self.blocking_send = blocking_send  # a send waits until every receiver took the bucket
        self._rooms: dict[bytes, _Room] = {}
        self._lock = threading.Lock()
        self.joins: list[tuple[int, int]] = []  # (rank, world_size) of every completed join

    def new_unique_id(self) -> bytes:
        return os.urandom(128)

    def open_group(self, unique_id: bytes, world_size: int, rank: int, device, timeout: float) -> LoopbackGroup:
        with self._lock:
            room = self._rooms.setdefault(unique_id, _Room(world_size, self.blocking_send))
        if room.world_size != world_size:
            raise TransportError(f"NCCL group init failed: world size {world_size} != {room.world_size}")
        deadline = time.monotonic() + timeout
        with room.cond:
            room.joined.add(rank)
            room.cond.notify_all()
            while len(room.joined) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(
                        f"NCCL group init (rank {rank} of {world_size}) did not complete within {timeout:.0f}s"
                    )
                room.cond.wait(left)
        with self._lock:
            self.joins.append((rank, world_size))
        return LoopbackGroup(room, rank, timeout)

    def sender(self, group: LoopbackGroup) -> LoopbackSender:
        return LoopbackSender(group)

    def receiver(self, group: LoopbackGroup, buckets) -> LoopbackReceiver:
        return LoopbackReceiver(group)
