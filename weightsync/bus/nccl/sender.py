"""The trainer's end of NCCL: the trainer is rank 0 of one NCCL group with every targeted rollout.

The trainer makes the ncclUniqueId and sends it in PrepareSync (the NcclTransport message); each rollout joins
in a receive thread while the trainer joins after every prepare has answered. The group is kept
across syncs while the membership — the set of (rollout_id, address) — is unchanged, and rebuilt
when it changes or after any failure, because a failed collective leaves the communicator aborted
on at least one rank. A collective needs every rank, so NCCL failures are group-wide: if one
target fails to prepare, join or receive, every target of that sync fails and is aborted.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from weightsync.bus.gpu import uuid_of as gpu_uuid
from weightsync.bus.nccl.liveness import GroupWatch
from weightsync.bus.session import RpcCall, kind_of
from weightsync.v1 import bus_pb2

log = logging.getLogger(__name__)

Member = tuple[str, str]  # (rollout_id, address)


@dataclass(frozen=True)
class GroupPlan:
    group_id: str
    unique_id: bytes
    members: tuple[Member, ...]
    fresh: bool  # the communicator must be built (True) or is the cached one (False)

    @property
    def world_size(self) -> int:
        return 1 + len(self.members)  # the trainer + one receiving rank per rollout process

    def rank_of(self, rollout_id: str) -> int:
        for i, (rid, _) in enumerate(self.members):
            if rid == rollout_id:
                return i + 1
        raise KeyError(f"rollout {rollout_id!r} is not a member of NCCL group {self.group_id}")


class NcclGroupCache:
    """The trainer's rank-0 communicator for one membership, reused until it changes or breaks."""

    def __init__(self, bus, device: torch.device, on_build: Callable[[], None] | None = None):
        self.bus, self.device = bus, device
        self._on_build = on_build or (lambda: None)
        self._group = None
        self._plan: GroupPlan | None = None
        self.builds = 0

    def plan(self, members: Iterable[Member]) -> GroupPlan:
        key = tuple(sorted(members))
        if self._group is not None and self._plan is not None and self._plan.members == key \
                and getattr(self._group, "healthy", True):
            return self._plan
        if self._group is not None:
            self.invalidate("membership changed" if self._plan and self._plan.members != key else "group broken")
        return GroupPlan(group_id=f"g-{uuid.uuid4().hex[:16]}", unique_id=self.bus.new_unique_id(), members=key,
                         fresh=True)

    def join(self, plan: GroupPlan, timeout: float):
        """The communicator for `plan`: the cached one, or a new one once every member has joined."""
        if not plan.fresh:
            return self._group
        group = self.bus.open_group(plan.unique_id, plan.world_size, 0, self.device, timeout)
        self._group, self._plan = group, replace(plan, fresh=False)
        self.builds += 1
        self._on_build()
        log.info("NCCL group %s built: world size %d (%s)", plan.group_id, plan.world_size,
                 ", ".join(rid for rid, _ in plan.members))
        return group

    def invalidate(self, reason: str) -> None:
        if self._group is not None:
            log.info("NCCL group %s dropped: %s", self._plan.group_id if self._plan else "?", reason)
            self._group.abort(reason)
        self._group, self._plan = None, None


class NcclSender:
    name = "nccl"

    def __init__(self, device: torch.device, bus=None, init_timeout: float = 120.0,
                 on_build: Callable[[], None] | None = None, uuid_of: Callable[[torch.device], str] = gpu_uuid,
                 call: RpcCall | None = None, watch_period: float = 1.0):
        self.device = torch.device(device)
        self.uuid_of = uuid_of
        self.call, self.watch_period = call, watch_period  # liveness of the members while streaming
        self.init_timeout = init_timeout
        self._bus = bus
        self._on_build = on_build
        self._cache: NcclGroupCache | None = None

    @property
    def cache(self) -> NcclGroupCache:
        if self._cache is None:
            if self._bus is None:
                from weightsync.bus.nccl.group import CudaNcclBus  # lazy: libnccl only when used

                self._bus = CudaNcclBus()
            self._cache = NcclGroupCache(self._bus, self.device, self._on_build)
        return self._cache

    def begin(self, targets: list, sync_id: str, bucket_bytes: int) -> "_NcclSession":
        needs_cuda = getattr(self._bus, "needs_cuda", True)
        if needs_cuda and self.device.type != "cuda":
            raise ValueError(f"transport=nccl needs the trainer's export on a CUDA device, and this trainer exports "
                             f"on {self.device}: run it on a GPU (backend hf: --device cuda:0) or use --transport tcp")
        return _NcclSession(self, self.cache.plan((e.rollout_id, e.address) for e in targets),
                            self.uuid_of(self.device))


class _NcclSession:
    name = "nccl"
    group_wide = True

    def __init__(self, owner: NcclSender, plan: GroupPlan, trainer_uuid: str = ""):
        self.owner, self.plan = owner, plan
        self.device = owner.device
        self.reused = not plan.fresh
        # GPU UUID -> who holds a rank on it; NCCL refuses two ranks on one GPU, but only after
        # every rank has waited out the init timeout, so the trainer refuses it at prepare.
        self._gpus = {trainer_uuid: "the trainer"} if trainer_uuid else {}
        self._watch: GroupWatch | None = None

    def spec_for(self, entry) -> bus_pb2.TransportSpec:
        spec = bus_pb2.TransportSpec()
        n = spec.nccl
        n.unique_id, n.world_size, n.rank_offset = self.plan.unique_id, self.plan.world_size, \
            self.plan.rank_of(entry.rollout_id)
        n.group_id, n.timeout_seconds, n.new_group = self.plan.group_id, self.owner.init_timeout, self.plan.fresh
        return spec

    def accept(self, entry, resp) -> str:
        if kind_of(resp) != "nccl" or resp.transport.nccl.group_id != self.plan.group_id:
            return (f"rollout answered an nccl prepare (group {self.plan.group_id}) with transport {kind_of(resp)} "
                    f"{resp.transport.nccl.group_id if kind_of(resp) == 'nccl' else ''}").rstrip()
        gpu = resp.transport.nccl.device_uuid
        if gpu:  # answers are taken in target order: of two rollouts on one GPU, the first listed keeps it
            other = self._gpus.setdefault(gpu, entry.rollout_id)
            if other != entry.rollout_id:
                return (f"nccl: this rollout receives on GPU {gpu}, and so does {other}; NCCL takes one rank per GPU: "
                        "give each rollout a GPU of its own (not the trainer's), or sync them one at a time "
                        "(wsctl sync --rollout ID)")
        return ""

    def open(self, targets: dict, timeout: float):
        group = self.owner.cache.join(self.plan, min(self.owner.init_timeout, timeout))
        group.timeout = timeout  # each broadcast wait is bounded by what is left of the sync
        if self.owner.call is not None:
            self._watch = GroupWatch(group, targets, self.owner.call, self.owner.watch_period).start()
        return self.owner.cache.bus.sender(group)

    def finish(self, ok: bool, reason: str) -> None:
        if self._watch is not None:
            self._watch.stop()
            if self._watch.tripped:
                ok, reason = False, self._watch.tripped
        if not ok:
            self.owner.cache.invalidate(reason)
