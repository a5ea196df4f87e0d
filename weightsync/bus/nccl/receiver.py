"""The rollout's end of NCCL: the cached communicators and the receive threads of a sync.

PrepareSync (the NcclTransport message) names one communicator per sending trainer rank: the
single group of global rank 0 (the fields of NcclTransport), or one per sender of a multi-sender
sync (`sender_groups`), each with that sender as its rank 0 and the rollouts at the same ranks in
every group. Separate communicators let the senders stream at once: collectives on one
communicator run one after another on every rank, so a group shared by several roots would
serialise them. `new_group` builds a communicator from the trainer's unique id (dropping the one
held for that sender), otherwise the rollout must still hold `group_id`, or it refuses, so a
restarted rollout makes the trainer rebuild instead of hanging everyone.
Each sender's join and receive run on a thread of their own (kept across syncs: RECEIVES) once the
transaction is prepared (the trainer's ranks join only once every prepare has answered); the thread
feeds `SyncTransaction.run_receiver` with that sender's buckets. A failure on any sender's group
aborts the whole sync and every group of it. When the trainer offered a delta base, every sender's
buckets come framed on its group (framed.py), each thread writing through the one delta base of the
sync (rollout_svc/sync/delta_base.py, which takes them under its lock).

A communicator is kept only if its sync received every bucket from it: a sync that ends early
(abort, error, timeout) may leave receives posted on it, so it is aborted and the next sync rebuilds.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from weightsync.bus.channel import BucketReceiver
from weightsync.bus.errors import SyncError
from weightsync.bus.gpu import require_cuda, uuid_of
from weightsync.bus.nccl.framed import FramedReceiver
from weightsync.bus.nccl.lazy_bus import LazyBus
from weightsync.bus.nccl.libnccl import UNIQUE_ID_BYTES
from weightsync.bus.plan import Manifest
from weightsync.bus.rollout_end import RolloutEnd
from weightsync.bus.workers import Job, Workers
from weightsync.v1 import bus_pb2

log = logging.getLogger(__name__)

_MAX_WORLD = 1 << 16
_MAX_GROUP_ID = 128
_MAX_SENDERS = 1 << 12
_MAX_TIMEOUT_S = 7 * 24 * 3600.0
_SETTLE_S = 5.0
#: the receives' threads, kept across syncs (weightsync/bus/workers.py)
RECEIVES = Workers("nccl-recv")

GroupKey = tuple[str, int, int]  # (group_id, world_size, rank)


@dataclass(frozen=True)
class SenderGroupSpec:
    """One communicator of a sync: the trainer rank that sends on it, and how to get it."""

    sender: int
    unique_id: bytes
    group_id: str
    new_group: bool


def sender_groups(spec: bus_pb2.NcclTransport) -> list[SenderGroupSpec]:
    """The communicators `spec` names, one per sending trainer rank (global rank 0 alone when
    `sender_groups` is empty)."""
    if not spec.sender_groups:
        return [SenderGroupSpec(0, spec.unique_id, spec.group_id, spec.new_group)]
    return [SenderGroupSpec(g.sender, g.unique_id, g.group_id, g.new_group) for g in spec.sender_groups]


class _CountingReceiver(BucketReceiver):
    """The bus receiver of one sender's buckets; aborts its communicator if the sync ends before its last bucket."""

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
class _Part:
    """One sender's share of the active sync."""

    group: object = None
    rx: _CountingReceiver | None = None
    thread: Job | None = None  # its receive, on a kept thread (RECEIVES)


@dataclass
class _Receive:
    sync_id: str
    parts: dict[int, _Part] = field(default_factory=dict)  # sender rank -> its share
    cancelled: str = ""

    @property
    def complete(self) -> bool:
        return all(p.rx is not None and p.rx.complete for p in self.parts.values())


class NcclReceiver(LazyBus, RolloutEnd):
    name = "nccl"

    def __init__(
        self, tx, device: torch.device | None, engine_name: str, bus=None, on_build: Callable[[], None] | None = None
    ):
        self.tx, self.device, self.engine_name = tx, device, engine_name
        self._bus = bus
        self._on_build = on_build or (lambda: None)
        self.uuid_of: Callable[[torch.device | None], str] = uuid_of  # tests name GPUs the loopback lacks
        self._lock = threading.Lock()
        self._groups: dict[int, tuple[object, GroupKey]] = {}  # sender rank -> (communicator, its key)
        self._active: _Receive | None = None
        self.builds = 0

    @property
    def group_id(self) -> str:
        """The group held for global rank 0's stream ("" if none)."""
        key = self.held_key(0)
        return key[0] if key else ""

    def held_key(self, sender: int = 0) -> GroupKey | None:
        """(group_id, world_size, rank) of the communicator held for `sender`, or None."""
        held = self._groups.get(sender)
        return held[1] if held else None

    def held_senders(self) -> list[int]:
        return sorted(self._groups)

    def device_uuid(self) -> str:
        return self.uuid_of(self.device)

    @classmethod
    def for_rollout(cls, side) -> "NcclReceiver":
        """`side.options["nccl"]`: `bus` (a stand-in for libnccl), `on_build` (counts groups built)."""
        return cls(side.tx, side.device, side.engine_name, **side.options.get(cls.name, {}))

    # ---- PrepareSync ----------------------------------------------------------------------
    def prepare(self, spec: bus_pb2.TransportSpec, manifest: Manifest, resp) -> None:
        self.check(spec.nccl, manifest.senders)
        n, asked = resp.transport.nccl, spec.nccl
        n.group_id, n.world_size, n.rank_offset = asked.group_id, asked.world_size, asked.rank_offset
        n.device_uuid = self.device_uuid()

    def receive(self, manifest: Manifest, spec: bus_pb2.TransportSpec, deadline: float, resp) -> None:
        # the trainer offered a delta base (answered either way): every bucket comes framed (framed.py)
        self.start(manifest, spec.nccl, deadline, framed=resp.delta_accepted or bool(resp.delta_refusal))

    def supersede(self, reason: str) -> None:
        self.cancel_active(reason)

    def check(self, spec: bus_pb2.NcclTransport, senders: list[int] | None = None) -> None:
        """Refuse, before anything is prepared, a sync this rollout cannot join. `senders`: the
        manifest's sending ranks, which must be exactly those the groups name."""
        if self.bus.needs_cuda:
            require_cuda(self.device, "nccl", self.engine_name)
        if not 2 <= spec.world_size <= _MAX_WORLD:
            raise SyncError(
                f"transport.nccl.world_size={spec.world_size} must be in [2, {_MAX_WORLD}] "
                "(the trainer plus every receiving rank)",
                "INVALID_ARGUMENT",
            )
        if not 1 <= spec.rank_offset < spec.world_size:
            raise SyncError(
                f"transport.nccl.rank_offset={spec.rank_offset} must be in [1, world_size="
                f"{spec.world_size}) (rank 0 is the trainer)",
                "INVALID_ARGUMENT",
            )
        t = spec.timeout_seconds
        if not (math.isfinite(t) and 0 <= t <= _MAX_TIMEOUT_S):
            raise SyncError(
                f"transport.nccl.timeout_seconds={t} must be finite and in [0, {_MAX_TIMEOUT_S:.0f}]",
                "INVALID_ARGUMENT",
            )
        groups = self._check_groups(spec)
        named = sorted(g.sender for g in groups)
        if senders is not None and named != sorted(senders):
            raise SyncError(
                f"transport.nccl names groups for sender ranks {named}, and the manifest's buckets come "
                f"from {sorted(senders)}: every sender needs exactly one group",
                "INVALID_ARGUMENT",
            )
        reused = [g for g in groups if not g.new_group]
        if not reused:
            return
        self._settle()
        with self._lock:
            for g in reused:
                held = self._groups.get(g.sender)
                ok = (
                    held is not None
                    and held[0].healthy
                    and held[1] == (g.group_id, spec.world_size, spec.rank_offset)
                    and (self._active is None or self._active.complete)
                )
                if not ok:
                    mine = held[1][0] if held else "none"
                    raise SyncError(
                        f"nccl group {g.group_id} (rank {spec.rank_offset} of {spec.world_size}) is not "
                        f"held here (for sender rank {g.sender} this rollout holds {mine}; restarted, or "
                        "its last sync failed): the trainer must build a new group",
                        "FAILED_PRECONDITION",
                    )

    @staticmethod
    def _check_groups(spec: bus_pb2.NcclTransport) -> list[SenderGroupSpec]:
        if spec.sender_groups and (spec.unique_id or spec.group_id or spec.new_group):
            raise SyncError(
                "transport.nccl sets sender_groups and the single-group fields (unique_id, group_id, "
                "new_group): a multi-sender sync names every group in sender_groups only",
                "INVALID_ARGUMENT",
            )
        if len(spec.sender_groups) > _MAX_SENDERS:
            raise SyncError(
                f"transport.nccl.sender_groups has {len(spec.sender_groups)} entries (at most {_MAX_SENDERS})",
                "INVALID_ARGUMENT",
            )
        groups = sender_groups(spec)
        where = "transport.nccl.sender_groups[{i}]" if spec.sender_groups else "transport.nccl"
        seen: set[int] = set()
        ids: set[str] = set()
        for i, g in enumerate(groups):
            at = where.format(i=i)
            if len(g.unique_id) != UNIQUE_ID_BYTES:
                raise SyncError(
                    f"{at}.unique_id has {len(g.unique_id)} bytes, an ncclUniqueId has {UNIQUE_ID_BYTES}",
                    "INVALID_ARGUMENT",
                )
            if not 0 < len(g.group_id) <= _MAX_GROUP_ID:
                raise SyncError(f"{at}.group_id must have 1..{_MAX_GROUP_ID} characters", "INVALID_ARGUMENT")
            if g.sender < 0 or g.sender in seen:
                raise SyncError(f"{at}.sender={g.sender}: each sending rank (>= 0) has one group", "INVALID_ARGUMENT")
            if g.group_id in ids:
                raise SyncError(f"{at}.group_id={g.group_id!r} names two groups", "INVALID_ARGUMENT")
            seen.add(g.sender)
            ids.add(g.group_id)
        return groups

    def start(self, manifest: Manifest, spec: bus_pb2.NcclTransport, deadline: float, framed: bool = False) -> None:
        """Join (or reuse) each sender's group and receive its buckets of the prepared `manifest`,
        one thread per sender. `framed`: the buckets come as frames, dense or delta (framed.py), and
        this rollout keeps them as its delta base (rollout_svc/sync/delta_base.py)."""
        groups = sender_groups(spec)
        with self._lock:
            self._cancel_locked(f"superseded by sync {manifest.sync_id}")
            named = {g.sender for g in groups}
            for sender in [s for s in self._groups if s not in named]:
                self._drop_group_locked(sender, f"sync {manifest.sync_id} has no group for sender {sender}")
            job = _Receive(manifest.sync_id)
            for g in groups:
                if g.new_group:
                    self._drop_group_locked(g.sender, f"replaced by group {g.group_id}")
                held = self._groups.get(g.sender)
                job.parts[g.sender] = _Part(group=None if g.new_group else (held[0] if held else None))
            self._active = job
        for g in groups:
            part = job.parts[g.sender]
            # on a kept thread: starting one per sync was on the path of every PrepareSync
            part.thread = RECEIVES.submit(
                functools.partial(self._receive, job, part, g, manifest, spec, deadline, framed)
            )

    def _receive(
        self,
        job: _Receive,
        part: _Part,
        g: SenderGroupSpec,
        manifest: Manifest,
        spec: bus_pb2.NcclTransport,
        deadline: float,
        framed: bool = False,
    ) -> None:
        key = (g.group_id, spec.world_size, spec.rank_offset)
        try:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            if g.new_group:
                left = deadline - time.monotonic()
                group = self.bus.open_group(
                    g.unique_id, spec.world_size, spec.rank_offset, self.device, min(spec.timeout_seconds or left, left)
                )
                with self._lock:
                    if job.cancelled:
                        group.abort(job.cancelled)
                        raise SyncError(f"sync aborted while joining the group ({job.cancelled})")
                    self._groups[g.sender] = (group, key)
                    part.group = group
                    self.builds += 1
                self._on_build()
                log.info(
                    "joined NCCL group %s (sender rank %d) as rank %d of %d",
                    g.group_id,
                    g.sender,
                    spec.rank_offset,
                    spec.world_size,
                )
            if part.group is None:
                raise SyncError(f"nccl group {g.group_id} of sender rank {g.sender} is no longer held here")
            group = part.group
            group.timeout = max(0.001, deadline - time.monotonic())
            mine = manifest.buckets_of(g.sender)
            if framed:
                base = getattr(self.tx, "delta_base", None)
                inner = FramedReceiver(group, mine, base.for_sync(manifest.sync_id) if base is not None else None)
            else:
                inner = self.bus.receiver(group, mine)
            rx = _CountingReceiver(inner, group, len(mine))
            with self._lock:
                if job.cancelled:
                    raise SyncError(f"sync aborted before receiving ({job.cancelled})")
                part.rx = rx
        except Exception as exc:
            log.error("sync %s: NCCL receive (sender rank %d) not started: %s", manifest.sync_id, g.sender, exc)
            self.tx.abort(manifest.sync_id, f"nccl group {g.group_id}: {exc}")
            self.abort(manifest.sync_id, f"sender rank {g.sender}'s group failed to start: {exc}")
            with self._lock:
                if part.group is not None:  # it may have receives posted by now; a newer sync's group is not ours
                    part.group.abort(f"sync {manifest.sync_id} failed to start receiving")
                    self._forget_locked(g.sender, part.group)
            return
        self.tx.run_receiver(manifest.sync_id, rx, g.sender)
        if not rx.complete:  # the transaction aborted the sync: stop the other senders' receives too
            self.abort(
                manifest.sync_id,
                f"the stream of sender rank {g.sender} ended after {rx.received}/{rx.num_buckets} buckets",
            )

    # ---- AbortSync / shutdown -------------------------------------------------------------
    def abort(self, sync_id: str, reason: str) -> None:
        """The sync is over without a commit: stop its receives (aborting every group left mid-stream)."""
        with self._lock:
            if self._active is not None and self._active.sync_id == sync_id:
                self._cancel_locked(reason)

    def cancel_active(self, reason: str) -> None:
        with self._lock:
            self._cancel_locked(reason)

    def close(self) -> None:
        with self._lock:
            self._cancel_locked("rollout shutting down")
            for sender in list(self._groups):
                self._drop_group_locked(sender, "rollout shutting down")

    def _cancel_locked(self, reason: str) -> None:
        job = self._active
        if job is None or job.cancelled:
            return
        job.cancelled = reason
        for sender, part in job.parts.items():
            if part.rx is not None and part.rx.complete:
                continue  # every bucket of this sender arrived: nothing is posted on its group, keep it
            if part.group is not None:
                part.group.abort(reason)  # wakes the receive thread's wait at once
                self._forget_locked(sender, part.group)

    def _forget_locked(self, sender: int, group) -> None:
        held = self._groups.get(sender)
        if held is not None and held[0] is group:
            del self._groups[sender]

    def _drop_group_locked(self, sender: int, reason: str) -> None:
        held = self._groups.pop(sender, None)
        if held is not None:
            held[0].abort(reason)

    def _settle(self) -> None:
        """Let the previous sync's threads finish their last bucket before judging whether the groups are reusable."""
        job = self._active
        if job is not None and job.complete:
            for part in job.parts.values():
                if part.thread is not None:
                    part.thread.join(_SETTLE_S)
