"""Multi-sender streaming: every trainer rank that assembles HF tensors streams its own buckets.

Rank 0 stays the only control-plane endpoint. Once the rollouts are prepared it hands every rank
a `SendJob` through the actor's command channel (JSON over the trainer's own gloo group): the
sync's identity and layout parameters — every rank recomputes the manifest from metadata and
checks its digest against rank 0's, so all agree on who sends which bucket without exchanging the
layout — the rollouts' data addresses, and for each sender the hello MAC of its (sync, sender)
pair; the token itself never leaves rank 0. Every rank then runs the export; each owner packs and
streams its own buckets to every rollout, concurrently with the other owners, with the usual
double-buffered pipeline (extra memory: two buckets plus the largest tensor it owns) — or, where
the actor can (megatron: `own_flat_buckets`; at TP > 1 with the shards its TP group sends it),
writes its buckets straight from its parameters once per sync and streams them in place, with no
export pass and no pack — and reports a `SenderResult` back to rank 0: its bucket checksums,
per-rollout failures, bytes and seconds.
Rank 0 merges them (`merge`) into the stream's outcome, so commit and abort reflect every sender.

Over NCCL the job carries, instead of data addresses and MACs, each sender's group (rank 0 plans
one per sender: weightsync/bus/nccl/sender.py); the rank builds or reuses its communicator
(weightsync/bus/nccl/sender_groups.py, kept on the actor across syncs) and broadcasts its buckets
on it from the GPU it exports on. A failed stream drops the rank's group; rank 0, seeing the
failure in the merged outcome, plans new groups for every sender.

A delta sync (weightsync/publisher/delta_sync.py) has every rank diff and keep the buckets it owns
(`DeltaRankJob` in the job); over NCCL each rank then frames its buckets on its own group.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from weightsync.bus.errors import TransportError
from weightsync.bus.nccl.liveness import Watch
from weightsync.bus.plan import Manifest, make_manifest
from weightsync.bus.tcp.wire import hello_mac
from weightsync.bus.transports import choices
from weightsync.obs import tracing
from weightsync.obs.bucket_groups import BucketGroups
from weightsync.publisher.export_format import PLAIN, export_format

log = logging.getLogger(__name__)


@dataclass
class SendJob:
    """What every trainer rank needs to stream its part of a sync (travels as JSON)."""

    sync_id: str
    version: int
    bucket_bytes: int
    model_family: str
    checksum_algo: str
    origin: str
    digest: str  # Manifest.digest() on rank 0
    targets: dict[str, str]  # rollout id -> TCP data address
    macs: dict[str, str]  # str(sender rank) -> hex hello MAC of (sync_id, sender)
    timeout: float  # seconds this stream may take
    transport: str = "tcp"  # tcp: `targets` and `macs`; nccl: `nccl_groups`
    nccl_groups: dict[str, dict] = field(default_factory=dict)  # str(sender rank) -> SenderGroupJob fields
    export_dtype: str = ""  # a quantized export format each rank applies to its own tensors ("": none)
    watch_period: float = 1.0  # nccl: how often a sender looks for rank 0's abort flag (seconds)
    #: delta syncs: every rank keeps its own buckets as its part of the base (DeltaRankJob)
    delta: dict = field(default_factory=dict)
    #: tracing is on at rank 0: each sender records its bucket groups (weightsync/obs/bucket_groups.py)
    trace_groups: bool = False

    @classmethod
    def make(
        cls,
        manifest: Manifest,
        targets: dict[str, str],
        token: str,
        timeout: float,
        nccl_groups: dict[str, dict] | None = None,
        export_dtype: str = "",
        watch_period: float = 1.0,
    ) -> "SendJob":
        common = dict(
            sync_id=manifest.sync_id,
            version=manifest.version,
            bucket_bytes=manifest.bucket_bytes,
            model_family=manifest.model_family,
            checksum_algo=manifest.checksum_algo,
            origin=manifest.origin,
            digest=manifest.digest(),
            timeout=timeout,
            export_dtype=export_dtype,
            watch_period=watch_period,
        )
        if nccl_groups is not None:
            missing = sorted(set(manifest.senders) - {int(s) for s in nccl_groups})
            if missing:
                raise ValueError(f"no NCCL group planned for sender rank(s) {missing}")
            return cls(**common, targets={}, macs={}, transport="nccl", nccl_groups=dict(nccl_groups))
        return cls(
            **common,
            targets=dict(targets),
            macs={str(s): hello_mac(token, manifest.sync_id, s).hex() for s in manifest.senders},
        )

    def to_args(self) -> dict:
        return asdict(self)

    @classmethod
    def from_args(cls, args: dict) -> "SendJob":
        return cls(**args)


@dataclass
class SenderResult:
    rank: int
    buckets: int = 0
    bytes: int = 0  # tensor bytes of the buckets it streamed (per receiver)
    seconds: float = 0.0
    #: of `seconds`, the time its stream waited on the bus (in its channel's sends: what the link did
    #: not hide behind the export); rank 0 measures the NCCL link by it (publisher/delta_sync.py)
    send_seconds: float = 0.0
    #: bytes/s of its fastest bucket (StreamStats.link_rate: the link's rate, not a slow receiver's)
    link_rate: float = 0.0
    error: str = ""  # the whole stream failed (every target misses its buckets)
    failures: dict[str, str] = field(default_factory=dict)  # rollout id -> why it was dropped
    checksums: list[list[int]] = field(default_factory=list)  # [bucket index, checksum]
    forwarded_bytes: int = 0  # other ranks' tensors it received first (the funnel only)
    peak_buffer_bytes: int = 0  # its pack buffers (<= 2 buckets)
    wire_bytes: dict[str, int] = field(default_factory=dict)  # rollout id -> what it put on the bus for it
    #: (nccl, framed) what it broadcast on its group, headers included: every member took all of it
    #: (the rank does not know the rollouts by id; rank 0 does); None: not counted (wire_bytes or total)
    broadcast_bytes: int | None = None
    #: of its buckets, how many it sent straight from its own parameters' storage (the actor's
    #: `own_flat_buckets`: no export pass, no pack copy); 0 when it exported and packed them
    flat_buckets: int = 0
    kept: bool = False  # (delta) every bucket it streamed is now its part of the base
    unchanged: bool = False  # (delta) ... and none differs from its part of the previous base
    #: its bucket groups for the trace (BucketGroups.groups), when the job asked for them
    groups: list[list] = field(default_factory=list)


def sender_manifest(metas, owners, job: SendJob) -> Manifest:
    return make_manifest(
        metas,
        owners=owners,
        version=job.version,
        sync_id=job.sync_id,
        bucket_bytes=job.bucket_bytes,
        model_family=job.model_family,
        checksum_algo=job.checksum_algo,
        origin=job.origin,
    )


def run_sender(actor, job: SendJob) -> SenderResult:
    """This rank's part of a multi-sender stream: export (always drained: the other ranks are in
    the same collectives), and stream the buckets this rank owns, if any."""
    from weightsync.bus.pipeline import stream_buckets

    t0 = time.perf_counter()
    deadline = time.monotonic() + job.timeout
    rank = actor.rank
    res = SenderResult(rank=rank)
    export = iter(())
    received: dict = {}
    try:
        export = iter(actor.export_own_tensors(received))
        # A quantized format maps each rank's own stream (weight -> FP8 weight + its scale, checked
        # for inf/nan at the stream's end), so every owner sends quantized bytes it quantized itself.
        fmt = export_format(job.export_dtype) if job.export_dtype else PLAIN
        plain = actor.export_metas()
        manifest = sender_manifest(fmt.metas(plain), fmt.owners(plain, actor.export_owners()), job)
        if manifest.digest() != job.digest:
            raise ValueError(
                f"rank {rank} computed a different bucket layout than rank 0 (digest "
                f"{manifest.digest()} != {job.digest}): every rank must run the same model config"
            )
        mine = manifest.buckets_of(rank)
        part = rank_delta_stream(actor, job, replace(manifest, buckets=mine))
        if mine:
            sender, device, watch = _bus_sender(actor, job, rank, deadline)
            channel, ok, recorder = sender, False, None
            try:
                try:
                    flat = own_flat_buckets(actor, replace(manifest, buckets=mine), job, part, device)
                except TransportError:
                    export = iter(())  # its flat path's exchange began: the export's would find no partner
                    raise
                if flat is not None:
                    # the actor takes the flat path only where its export runs no collective, or where
                    # every rank of the export's collectives took the flat path with it (megatron's TP
                    # group): this rank's export is never started, and no other rank waits for it
                    export = iter(())
                    res.flat_buckets = len(mine)
                channel = sender if part is None else part.channel(sender)
                recorder = BucketGroups([b.index for b in mine]) if job.trace_groups else None
                stats = stream_buckets(
                    replace(manifest, buckets=mine),
                    fmt.tensors(export),
                    channel,
                    device=device,
                    timeout=max(0.001, deadline - time.monotonic()),
                    with_checksums=part is None,  # a kept bucket's checksum is summed as it is diffed
                    in_place=flat,
                    on_sent=None if recorder is None else recorder.sent,
                )
                ok = True
                checksums = stats.checksums if part is None else part.checksums
                res.checksums = [[b.index, c] for b, c in zip(mine, checksums)]
                res.buckets, res.bytes = len(mine), sum(b.tensor_bytes for b in mine)
                res.peak_buffer_bytes = stats.peak_buffer_bytes
                res.send_seconds, res.link_rate = stats.send_seconds, stats.link_rate
            finally:
                if watch is not None:
                    watch.stop()
                if part is not None:
                    part.finish(ok)
                    res.kept, res.unchanged = part.base.held is not None, part.unchanged
                if recorder is not None:
                    res.groups = recorder.close()
                res.failures = sender.failures()
                res.wire_bytes = dict(sender.wire_bytes)
                res.broadcast_bytes = channel.wire_bytes_sent  # a framed broadcast
                sender.close()
            if watch is not None and watch.tripped:  # the stream may have ended just as the flag came up
                raise TransportError(f"rank 0 ended the stream: {watch.tripped}")
        else:
            # a rank that owns no bucket may still take part in its owners' flat path (megatron at TP > 1
            # sends its shards to its stage's leader): its export is then never started, as theirs
            try:
                if (
                    own_flat_buckets(actor, replace(manifest, buckets=mine), job, part, export_device(actor))
                    is not None
                ):
                    export = iter(())
            except TransportError:
                export = iter(())
                raise
    except Exception as exc:  # reported to rank 0, which fails the targets; never kills the worker
        res.error = f"rank {rank}: {exc}"
        end = RANK_ENDS.get(job.transport)
        if end is not None:
            end.failed(actor, job, exc)
        log.warning("sync %s: sender rank %d failed: %s", job.sync_id, rank, exc)
    finally:
        for _ in export:
            pass
        res.seconds = time.perf_counter() - t0
        res.forwarded_bytes = int(received.get("forwarded_bytes", 0))
    return res


def own_flat_buckets(actor, mine: Manifest, job: SendJob, part, device) -> list[torch.Tensor] | None:
    """This rank's buckets written straight from its parameters (the actor's `own_flat_buckets`:
    megatron, trainer_svc/actor/megatron/flat_export.py), streamed in place; None: export and pack
    them. A quantized format maps the exported tensors, so it always packs (on every rank alike).
    Every rank asks, its buckets none or some: where the actor's flat path is a collective (megatron
    at TP > 1: a TP group's ranks send their shards to its leader) all of them must, and a rank that
    declines for its own reasons tells the actor so (`decline_own_flat`), which tells its group. A
    TransportError from the actor (its collective began, then failed) fails the rank's stream: the
    other ranks went flat with it, so packing would leave its export waiting in gathers for them.

    A delta part (rank_delta_stream) diffs and keeps in-place buckets as it does packed ones, but
    keeps its copy on the buckets' device: on a GPU rank streaming over TCP (packed in host memory,
    `device`) that copy would move from host to GPU memory, a model-sized difference, so such a rank
    packs as before (sync_encoding=full, or NCCL, sends its GPU buckets in place)."""
    from weightsync.bus.layout import layout_digest

    if not actor.own_flat or job.export_dtype:
        return None
    # the key the actor plans once per layout under (the sync's own digest also names the sync)
    mine = replace(mine, layout_digest=layout_digest(mine))
    if part is not None and part.keep and export_device(actor) != torch.device(device):
        actor.decline_own_flat(mine)
        return None
    try:
        return actor.own_flat_buckets(mine)
    except TransportError:  # the actor's flat path failed after a collective began: packing would hang
        raise
    except Exception:  # an optimisation only: every parameter still holds its value; pack instead
        log.exception(
            "sync %s: rank %d could not lay out its buckets from its parameters; packing", job.sync_id, actor.rank
        )
        return None


def rank_delta_stream(actor, job: SendJob, mine: Manifest):
    """This rank's part of a delta sync (DeltaRankJob in job.delta), or None: its buckets in full,
    nothing kept. Its part of the base is on the actor across syncs (delta_sync.rank_part)."""
    from weightsync.publisher.delta_sync import DeltaRankJob, rank_part

    if not job.delta:
        part = actor.rank_sync_state().delta_part
        if part is not None:
            part.drop()  # a sync that keeps nothing: the next delta starts afresh
        return None
    return rank_part(actor).stream(DeltaRankJob(**job.delta), mine)


def nccl_groups(actor):
    """This rank's multi-sender NCCL communicator, kept on the actor across syncs."""
    from weightsync.bus.nccl.sender_groups import SenderGroupCache

    state = actor.rank_sync_state()
    if state.nccl_groups is None:
        state.nccl_groups = SenderGroupCache()
    return state.nccl_groups


def export_device(actor) -> torch.device:
    """Where this rank's exported tensors live, and so where its buckets are packed."""
    for p in actor.parameters():
        return p.device
    return torch.device("cpu")


def _bus_sender(actor, job: SendJob, rank: int, deadline: float):
    """(the bucket sender of this rank's stream, the device its buckets are packed on, the watch
    that aborts its NCCL group when rank 0 raises the sync's abort flag, or None)."""
    end = RANK_ENDS.get(job.transport)
    if end is None:
        raise ValueError(f"SendJob.transport={job.transport!r} must be {choices(RANK_ENDS)}")
    return end.open(actor, job, rank, max(0.001, deadline - time.monotonic()))


class _TcpRank:
    """A rank's stream over TCP: a connection to every rollout's data port, opened with its own hello MAC."""

    @staticmethod
    def open(actor, job: SendJob, rank: int, left: float):
        from weightsync.bus.tcp.wire import TcpBucketSender
        from weightsync.publisher.drop_follow import follow_drops

        sender = TcpBucketSender(
            job.targets, job.sync_id, "", timeout=left, sender=rank, mac=bytes.fromhex(job.macs[str(rank)])
        )
        # a dead rollout breaks its own connection; a stopped one is dropped on rank 0's word
        return sender, torch.device("cpu"), follow_drops(actor, job.sync_id, sender)

    @staticmethod
    def failed(actor, job: SendJob, exc: Exception) -> None:
        pass


class _NcclRank:
    """A rank's stream over NCCL: a broadcast on its own group (kept on the actor across syncs)."""

    @staticmethod
    def open(actor, job: SendJob, rank: int, left: float):
        from weightsync.bus.nccl.sender_groups import SenderGroupJob

        spec = job.nccl_groups.get(str(rank))
        if spec is None:
            raise ValueError(f"rank {rank} owns buckets but the job plans no NCCL group for it")
        device = export_device(actor)
        cache = nccl_groups(actor)
        group = cache.get(SenderGroupJob(**spec), device, left)
        group.timeout = left  # each broadcast wait is bounded by what is left of the stream
        watch = None
        flags = actor.stream_flags
        if flags is not None:  # NCCL never tells this rank that a rollout died; rank 0 sees it and says so
            watch = Watch(
                lambda: flags.raised(job.sync_id),
                group.abort,
                job.watch_period,
                what=f"rank {rank}'s NCCL sender group",
            ).start()
        return cache.bus.sender(group), device, watch

    @staticmethod
    def failed(actor, job: SendJob, exc: Exception) -> None:
        # the collective may have failed on some rank: never reuse it
        nccl_groups(actor).drop(f"sync {job.sync_id} failed on this rank: {exc}")


#: how one rank streams its part over each multi-sender transport (weightsync.bus.transports:
#: multi_sender; tests/unit/weightsync/bus/test_transports.py checks that every one has its entry)
RANK_ENDS = {"tcp": _TcpRank, "nccl": _NcclRank}


@dataclass
class StreamOutcome:
    checksums: list[int]  # by bucket index; complete only when error == ""
    failures: dict[str, str]  # rollout id -> why it misses some sender's buckets
    error: str  # a sender failed as a whole: no target can commit
    senders: list[SenderResult]  # one per sending rank, in rank order


def merge(manifest: Manifest, results: list[SenderResult]) -> StreamOutcome:
    """One outcome from every rank's report: a rollout that any sender dropped fails; a sender that
    failed outright (or a bucket without a checksum) fails every rollout."""
    by_index: dict[int, int] = {}
    failures: dict[str, str] = {}
    errors = [r.error for r in results if r.error]
    for r in results:
        for i, c in r.checksums:
            by_index[int(i)] = int(c)
        for rid, err in r.failures.items():
            failures.setdefault(rid, f"sender rank {r.rank}: {err}")
    if not errors and len(by_index) != len(manifest.buckets):
        missing = sorted(set(range(len(manifest.buckets))) - set(by_index))
        errors.append(f"no sender streamed bucket(s) {missing[:8]} (of {len(manifest.buckets)})")
    checksums = [by_index.get(i, 0) for i in range(len(manifest.buckets))]
    senders = [r for r in results if r.rank in set(manifest.senders)]
    return StreamOutcome(checksums, failures, "; ".join(errors), senders)


def stream_from_every_owner(
    actor,
    manifest: Manifest,
    targets: dict[str, str],
    token: str,
    timeout: float,
    nccl_groups: dict[str, dict] | None = None,
    export_dtype: str = "",
    watch_period: float = 1.0,
    delta=None,
) -> StreamOutcome:
    """Rank 0: run a multi-sender stream of `manifest` to `targets` (rollout id -> data address),
    or, with `nccl_groups` (str(sender) -> its SenderGroupJob fields), over each sender's NCCL group.
    `export_dtype`: a quantized export format (fp8-block) every rank applies to its own tensors.
    `delta`: a DeltaRankJob (delta_sync.py): every rank diffs and keeps its own buckets."""
    job = SendJob.make(manifest, targets, token, timeout, nccl_groups, export_dtype, watch_period)
    if delta is not None:
        job.delta = asdict(delta)
    job.trace_groups = tracing.enabled()
    results = [SenderResult(**r) for r in actor.run_senders(job.to_args())]
    return merge(manifest, results)
