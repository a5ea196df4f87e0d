"""The trainer's end of NCCL, planned on global rank 0.

Funnel (one sender): the trainer is rank 0 of one NCCL group with every targeted rollout. The
trainer makes the ncclUniqueId and sends it in PrepareSync (the NcclTransport message); each
rollout joins in a receive thread while the trainer joins after every prepare has answered.

Multi-sender (the manifest's buckets come from several trainer ranks): one group per sending
rank, that rank as its rank 0 and the rollouts at the same ranks in every group. Collectives on
one communicator run in order on every rank, so one group with several roots would make the
senders take turns; a group each lets them stream at once. Rank 0 makes every group's unique id
(the id is only a rendezvous address: rank 0's process hosts the bootstrap, the sending rank
joins with it) and hands each rank its own in the SendJob; the communicators live in the sending
ranks (weightsync/bus/nccl/sender_groups.py).

Groups are kept across syncs while the membership — the set of (rollout_id, address), and the
senders — is unchanged, and rebuilt when it changes or after any failure, because a failed
collective leaves the communicator aborted on at least one rank. A collective needs every rank,
so NCCL failures are group-wide: if one target fails to prepare, join or receive, every target
of that sync fails and is aborted.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace

import torch

from weightsync.bus.gpu import uuid_of as gpu_uuid
from weightsync.bus.nccl.cut import MemberCut
from weightsync.bus.nccl.lazy_bus import LazyBus
from weightsync.bus.nccl.liveness import Watch, members_probe
from weightsync.bus.nccl.sender_groups import SenderGroupJob
from weightsync.bus.session import RpcCall, Sender, Session, kind_of
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
    """Rank 0's plans: its own communicator for the funnel, or one group per sender, reused until
    the membership changes or a sync fails."""

    def __init__(self, bus, device: torch.device, on_build: Callable[[], None] | None = None):
        self.bus, self.device = bus, device
        self._on_build = on_build or (lambda: None)
        self._group = None
        self._plan: GroupPlan | None = None
        self._multi: dict[int, GroupPlan] = {}  # sender rank -> its group (the communicators live there)
        self.builds = 0

    def plan(self, members: Iterable[Member]) -> GroupPlan:
        key = tuple(sorted(members))
        if self._multi:
            self.invalidate("the sync streams from global rank 0 alone")
        if self._group is not None and self._plan is not None and self._plan.members == key and self._group.healthy:
            return self._plan
        if self._group is not None:
            self.invalidate("membership changed" if self._plan and self._plan.members != key else "group broken")
        return GroupPlan(
            group_id=f"g-{uuid.uuid4().hex[:16]}", unique_id=self.bus.new_unique_id(), members=key, fresh=True
        )

    def plan_senders(self, members: Iterable[Member], senders: Iterable[int]) -> dict[int, GroupPlan]:
        """One group per sending rank; the held plans while members and senders are unchanged."""
        key, senders = tuple(sorted(members)), sorted(set(senders))
        if self._group is not None:
            self.invalidate("the sync streams from several ranks")
        held = self._multi
        if held and sorted(held) == senders and all(p.members == key and not p.fresh for p in held.values()):
            return dict(held)
        if held:
            self.invalidate(
                "membership or senders changed"
                if any(p.members != key for p in held.values()) or sorted(held) != senders
                else "groups never completed"
            )
        self._multi = {
            s: GroupPlan(
                group_id=f"g-{uuid.uuid4().hex[:12]}-s{s}", unique_id=self.bus.new_unique_id(), members=key, fresh=True
            )
            for s in senders
        }
        return dict(self._multi)

    def built_senders(self) -> None:
        """Every sender's group was built and streamed: reuse them."""
        if any(p.fresh for p in self._multi.values()):
            self.builds += 1
            self._on_build()
        self._multi = {s: replace(p, fresh=False) for s, p in self._multi.items()}

    def join(self, plan: GroupPlan, timeout: float):
        """The communicator for `plan`: the cached one, or a new one once every member has joined."""
        if not plan.fresh:
            return self._group
        group = self.bus.open_group(plan.unique_id, plan.world_size, 0, self.device, timeout)
        self._group, self._plan = group, replace(plan, fresh=False)
        self.builds += 1
        self._on_build()
        log.info(
            "NCCL group %s built: world size %d (%s)",
            plan.group_id,
            plan.world_size,
            ", ".join(rid for rid, _ in plan.members),
        )
        return group

    def invalidate(self, reason: str) -> None:
        if self._group is not None:
            log.info("NCCL group %s dropped: %s", self._plan.group_id if self._plan else "?", reason)
            self._group.abort(reason)
        if self._multi:
            log.info("NCCL sender groups %s dropped: %s", ", ".join(p.group_id for p in self._multi.values()), reason)
        self._group, self._plan, self._multi = None, None, {}


class NcclSender(LazyBus, Sender):
    name = "nccl"

    def __init__(
        self,
        device: torch.device,
        bus=None,
        init_timeout: float = 120.0,
        on_build: Callable[[], None] | None = None,
        uuid_of: Callable[[torch.device], str] = gpu_uuid,
        call: RpcCall | None = None,
        watch_period: float = 1.0,
    ):
        self.device = torch.device(device)
        self.uuid_of = uuid_of
        self.call, self.watch_period = call, watch_period  # liveness of the members while streaming
        self.init_timeout = init_timeout
        self._bus = bus
        self._on_build = on_build
        self._cache: NcclGroupCache | None = None

    @classmethod
    def for_trainer(cls, side) -> "NcclSender":
        """`side.options["nccl"]`: `bus` (a stand-in for libnccl), `init_timeout`, `on_build`."""
        return cls(side.device, call=side.call, **side.options.get(cls.name, {}))

    @property
    def cache(self) -> NcclGroupCache:
        if self._cache is None:
            self._cache = NcclGroupCache(self.bus, self.device, self._on_build)
        return self._cache

    def begin(self, targets: list, sync_id: str, bucket_bytes: int) -> "_NcclSession":
        needs_cuda = self.cache.bus.needs_cuda
        if needs_cuda and self.device.type != "cuda":
            raise ValueError(
                f"transport=nccl needs the trainer's export on a CUDA device, and this trainer exports "
                f"on {self.device}: run it on a GPU (backend hf: --device cuda:0) or use --transport tcp"
            )
        return _NcclSession(self, [(e.rollout_id, e.address) for e in targets], self.uuid_of(self.device), sync_id)


class _NcclSession(Session):
    name = "nccl"
    group_wide = True

    def __init__(self, owner: NcclSender, members: Iterable[Member], trainer_uuid: str = "", sync_id: str = ""):
        self.owner, self.sync_id = owner, sync_id
        self.members: tuple[Member, ...] = tuple(sorted(members))
        self.device = owner.device
        self._plan: GroupPlan | None = None
        #: sender rank -> its group, when several trainer ranks stream (use_senders)
        self.sender_plans: dict[int, GroupPlan] = {}
        # GPU UUID -> who holds a rank on it; NCCL refuses two ranks on one GPU, but only after
        # every rank has waited out the init timeout, so the trainer refuses it at prepare.
        self._gpus = {trainer_uuid: "the trainer"} if trainer_uuid else {}
        self._sender_gpus: dict[str, int] = {}  # GPU UUID -> the sending rank (not 0) on it
        self.sender_gpu_clash = ""
        self.clashing: set[str] = set()  # rollouts on a sending rank's GPU
        self._watch: Watch | None = None
        self._probe = None  # the watch's MembersProbe
        #: a member silent, dead or out of the sync mid-stream ends the stream for all, and the live
        #: members are restarted without it (cut.py); armed once the stream has a group
        self.cuts = MemberCut(rid for rid, _ in self.members)

    @property
    def plan(self) -> GroupPlan:
        """Global rank 0's group (the funnel), planned on first use."""
        if self._plan is None:
            self._plan = self.owner.cache.plan(self.members)
        return self._plan

    @property
    def reused(self) -> bool:
        """Every group of this sync is one the members already hold."""
        if self.sender_plans:
            return not any(p.fresh for p in self.sender_plans.values())
        return not self.plan.fresh

    def use_senders(self, senders: list[int], rank_gpus: list[str] | None = None) -> None:
        """Several trainer ranks stream this sync: plan a group for each instead of rank 0's.
        `rank_gpus`: each global rank's GPU UUID, so that a rollout on a sending rank's GPU is
        caught at prepare (NCCL refuses two ranks of a group on one GPU)."""
        if len(set(senders)) > 1:
            self.sender_plans = self.owner.cache.plan_senders(self.members, senders)
            for rank in senders:
                gpu = (rank_gpus or [])[rank] if rank < len(rank_gpus or []) else ""
                if gpu and rank != 0:
                    self._sender_gpus[gpu] = rank

    def spec_for(self, entry) -> bus_pb2.TransportSpec:
        spec = bus_pb2.TransportSpec()
        n = spec.nccl
        rank = GroupPlan("", b"", self.members, True).rank_of(entry.rollout_id)
        n.world_size, n.rank_offset = 1 + len(self.members), rank
        n.timeout_seconds = self.owner.init_timeout
        if self.sender_plans:
            for sender, p in sorted(self.sender_plans.items()):
                n.sender_groups.add(sender=sender, unique_id=p.unique_id, group_id=p.group_id, new_group=p.fresh)
        else:
            n.unique_id, n.group_id, n.new_group = self.plan.unique_id, self.plan.group_id, self.plan.fresh
        return spec

    def accept(self, entry, resp) -> str:
        want = "" if self.sender_plans else self.plan.group_id
        if kind_of(resp) != "nccl" or resp.transport.nccl.group_id != want:
            return (
                f"rollout answered an nccl prepare (group {want or 'per sender'}) with transport {kind_of(resp)} "
                f"{resp.transport.nccl.group_id if kind_of(resp) == 'nccl' else ''}"
            ).rstrip()
        gpu = resp.transport.nccl.device_uuid
        if gpu in self._sender_gpus:
            self.clashing.add(entry.rollout_id)
            self.sender_gpu_clash = (
                f"rollout {entry.rollout_id} receives on the GPU of trainer rank "
                f"{self._sender_gpus[gpu]}, which sends on its own NCCL group"
            )
            return (
                f"nccl: this rollout receives on GPU {gpu}, where trainer rank {self._sender_gpus[gpu]} sends; "
                "NCCL takes one rank per GPU: the sync is retried through global rank 0 (senders=rank0)"
            )
        if gpu:  # answers are taken in target order: of two rollouts on one GPU, the first listed keeps it
            other = self._gpus.setdefault(gpu, entry.rollout_id)
            if other != entry.rollout_id:
                return (
                    f"nccl: this rollout receives on GPU {gpu}, and so does {other}; NCCL takes one rank per GPU: "
                    "give each rollout a GPU of its own (not the trainer's), or sync them one at a time "
                    "(wsctl sync --rollout ID)"
                )
        return ""

    def sender_jobs(self, timeout: float) -> dict[str, dict]:
        """str(sender rank) -> the SenderGroupJob fields of its group (multi-sender only)."""
        return {
            str(s): asdict(
                SenderGroupJob(
                    group_id=p.group_id,
                    unique_id=p.unique_id.hex(),
                    new_group=p.fresh,
                    world_size=p.world_size,
                    init_timeout=min(self.owner.init_timeout, timeout),
                )
            )
            for s, p in self.sender_plans.items()
        }

    def owner_streams(self, prepared: dict, timeout: float, raise_flag) -> tuple[dict, dict[str, dict], float]:
        # each sender broadcasts on its own group: no data addresses
        groups = self.sender_jobs(timeout)
        if raise_flag is not None:  # every sender ends its broadcasts once a rollout can no longer take part
            self.cuts.arm(raise_flag)
            self.watch(prepared, raise_flag)
        return {}, groups, self.owner.watch_period

    def open(self, targets: dict, timeout: float):
        group = self.owner.cache.join(self.plan, min(self.owner.init_timeout, timeout))
        group.timeout = timeout  # each broadcast wait is bounded by what is left of the sync
        self.cuts.arm(group.abort)
        self.watch(targets, group.abort)
        return self.owner.cache.bus.sender(group)

    def watch(self, targets: dict, abort) -> None:
        """While the stream runs, `abort(reason)` once a target can no longer take part (dead, or
        out of the sync): rank 0's group, or with several senders the flag they all watch."""
        if self.owner.call is not None:
            probe = members_probe(targets, self.owner.call, self.sync_id, wait_s=self.owner.watch_period)
            self._probe = probe

            def end(verdict: str) -> None:  # the member it names is cut: the live ones restart without it
                if not (probe.culprit and self.cuts.cut(probe.culprit, verdict)):
                    abort(verdict)

            self._watch = Watch(probe, end, self.owner.watch_period, on_stop=probe.close).start()

    def committing(self, rollout_ids) -> None:
        if self._probe is not None:
            self._probe.committing.update(rollout_ids)

    def cut(self, rollout_id: str, why: str) -> bool:
        """End this sync's stream for every member because `rollout_id` went silent mid-stream (cut.py)."""
        return self.cuts.cut(rollout_id, why)

    def cut_reasons(self) -> dict[str, str]:
        return self.cuts.why

    def finish(self, ok: bool, reason: str) -> None:
        if self._watch is not None:
            self._watch.stop()
            if self._watch.tripped:
                ok, reason = False, self._watch.tripped
        if not ok:
            self.owner.cache.invalidate(reason)
        elif self.sender_plans:
            self.owner.cache.built_senders()
