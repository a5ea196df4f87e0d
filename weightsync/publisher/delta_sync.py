"""Delta syncs on the trainer: the last committed export kept as the base, and per sync, who gets deltas.

`sync_encoding` (trainer config): full sends every bucket dense; delta and auto keep a copy of the
buckets of the last export streamed in full to the end (host memory on the tcp path: one copy of the
model's export bytes, bounded by `delta_base_mb`), and offer every target of the next sync that base
in PrepareSync. A rollout that holds exactly that base — it committed one of the syncs whose
streams were the base's bytes, and kept its copy (rollout_svc/sync/delta_base.py) — accepts, and
gets each bucket as the words that changed (weightsync/bus/delta/codec.py) where that is smaller; the
others (missed a version, restarted, joined late) get it dense, in the same stream. Each bucket's
checksum is of the dense bucket, so the rollout's check is of the result.

The base is named by those syncs, not by its version alone: several syncs can stream one version
(a catch-up per registering rollout, then the fleet), each to other targets, and the base follows
the last. A stream that changed no byte of the base adds its sync to the names (the rollouts
caught up earlier still hold the base); one that changed any byte — an exporter that is not
deterministic at one version — replaces them, so a rollout on the earlier bytes is sent in full
rather than a delta that would fail its checksum. (Packing zeroes the alignment gaps between
tensors for the same reason: weightsync/bus/pack.py.)

Which syncs: delta is carried by tcp (the link is the bottleneck there) and by nccl, from one sender
or several (the buckets then go framed: weightsync/bus/nccl/framed.py; a broadcast reaches every
member alike, so a bucket goes as a delta only when every target accepted the base). `auto` picks full for
ipc (a colocated rollout reads the trainer's buffers over the GPU's memory: a delta would cost more
HBM passes — compare, read the base, write it back — than it saves), and on nccl decides by the
link's measured rate. A delta costs the codec's passes (the trainer's compare in the stream, the
rollout's apply in the commit: a fixed time per byte of export, whatever the link) and saves most of
the link's time, so it wins below a break-even link rate. bench/bench_delta_nccl.py measures both
sides (docs/BENCHMARKS.md): on the GPUs measured, every inter-host link in use (100-400 Gb/s IB/RoCE)
is below the break-even and NVLink within a host above it. So under auto each full nccl sync
measures the link (`DeltaStream.streamed`: the rate of its fastest bucket, the bucket's bytes over the
send wait its transfer ended in, the link's time the export did not hide; a slow receiver lengthens some
buckets' waits but cannot make any bucket faster than the link; with several senders the slowest rank's),
and while that rate is below `delta_link_gbps` (trainer config, default 400 Gb/s = 50 GB/s: below the
measured break-even, above every inter-host link; 0: never) the next sync keeps its base, so the one
after offers it. Until a rate is measured, or while it is at or above the knob, auto on nccl is full
and keeps no base (no GPU memory spent over NVLink). Every full nccl sync measures afresh (one the
rollouts took dense because one of them missed a version too); a delta sync does not (its sends
encode), nor a sync on a group built in it (NCCL sets its connections up at the first broadcast).
The gauge `weightsync_nccl_link_bytes_per_second` shows the last rate. `delta` forces deltas on any
nccl link, and is refused on ipc. On nccl the trainer's base is kept where it exports (its GPU) and
the rollout's on its GPU: one more copy of the export bytes on each.

With several senders (multisender.py) each rank keeps and diffs the buckets it owns (`RankPart`, on
its actor: host memory for its share of the export over tcp, its GPU over nccl) and rank 0 keeps
only the base's name: a rank uses its part only when its last stream is the one rank 0 names
(DeltaRankJob.base), so a rank whose part was dropped, or a base rank 0 dropped, sends its buckets
dense (which a rollout that accepted the delta takes as well). Over nccl each sending rank
broadcasts on a group of its own (weightsync/bus/nccl/sender_groups.py) and frames its buckets
there once rank 0 offered a base (`DeltaRankJob.framed`: the rollouts, told by PrepareSync alone,
receive every group framed over their delta base), dense frames included: a rank without a usable
part still frames. Rank 0 settles, before the ranks start, whether the frames may be deltas: only
when every target accepted the base (`broadcast_to`), for every rank's group alike.

A sync that keeps its buckets computes their checksums here, not in the pipeline's producer: the
checksum (weightsync/bus/copy/checksum.py) is a wrapping sum of 32-bit words and of their squares, so
the new bucket's follows from the base's sums and the words that changed — the one pass over the
bucket is the comparison the delta needs anyway. It is still the checksum of the whole new bucket,
which every rollout checks against its own full pass over the result; should the trainer's copy
or sums ever be wrong, a rollout sent the bucket in full refuses it (DATA_LOSS at receipt, or a
failed commit), and that drops the base (`commit_failed`): the next sync starts afresh.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from weightsync.bus.channel import BucketSender
from weightsync.bus.copy.checksum import from_sums, word_sums
from weightsync.bus.delta.codec import diff, encode, word_bytes
from weightsync.bus.plan import BucketPlan, Manifest
from weightsync.sync_options import DEFAULTS
from weightsync.v1 import rollout_pb2

log = logging.getLogger(__name__)

ENCODINGS = ("full", "delta", "auto")
#: transports whose channel carries delta frames (TcpBucketSender.send(..., delta=...))
DELTA_TRANSPORTS = ("tcp", "nccl")
#: auto on nccl: deltas below this link rate (Gb/s; trainer config delta_link_gbps). 50 GB/s: under the
#: measured break-even of the GPUs benchmarked, above every inter-host link in use (100-400 Gb/s)
LINK_GBPS = DEFAULTS.delta_link_gbps
#: syncs named in an offer at most (catch-ups of that many rollouts at one version keep the base)
_MAX_STREAMS = 64


class DeltaBase:
    """The trainer's copy of the last export it streamed in full, and which version that is."""

    def __init__(
        self,
        encoding: str = "auto",
        limit_bytes: int = DEFAULTS.delta_base_bytes,
        origin: str = "",
        link_gbps: float = LINK_GBPS,
    ):
        if encoding not in ENCODINGS:
            raise ValueError(f"sync_encoding={encoding!r} must be full, delta or auto")
        if not link_gbps >= 0:  # NaN too
            raise ValueError(f"delta_link_gbps={link_gbps} must be >= 0 (Gb/s; 0: auto stays full on nccl)")
        self.encoding, self.limit_bytes, self.origin = encoding, limit_bytes, origin
        #: auto on nccl: deltas while the link's measured rate is below this (Gb/s); 0: never
        self.link_gbps = link_gbps
        #: the NCCL link's rate (bytes/s) as the last full nccl sync on a reused group measured it, or None
        self.link_rate: float | None = None
        self._logged_slow: bool | None = None  # the auto-on-nccl decision last logged
        self._bufs: dict[int, torch.Tensor] = {}
        #: bucket index -> int64 [sum, sum of squares] of the words of its base (checksum.word_sums)
        self._sums: dict[int, torch.Tensor] = {}
        #: (version, layout_digest) of the export the copy holds, or None
        self.held: tuple[int, str] | None = None
        #: the syncs whose streams were exactly the copy's bytes (with `held`): the base is offered
        #: only to a rollout that committed one of them, never on the version alone
        self.streams: tuple[str, ...] = ()
        self._warned = False

    def begin(self, manifest: Manifest, transport: str) -> DeltaStream:
        """This sync's part: what it offers (None: full for everyone) and whether it keeps its buckets."""
        self.check(transport)
        why = self._no_delta(manifest, transport)
        if why:
            self.drop()
            if self.encoding == "delta" and not self._warned:
                log.warning("sync_encoding=delta: sync %s goes in full: %s", manifest.sync_id, why)
                self._warned = True
            return DeltaStream(self, manifest, None, keep=False, transport=transport)
        offer, prior = None, ()
        if self.held is not None and self.held[1] == manifest.layout_digest:
            prior = self.streams
            offer = rollout_pb2.DeltaBase(
                version=self.held[0], origin=self.origin, layout_digest=self.held[1], sync_ids=prior
            )
        if manifest.layout_digest != (self.held or (0, manifest.layout_digest))[1]:
            self._bufs, self._sums = {}, {}  # another layout: the old buckets are of no use
        self.held, self.streams = None, ()  # the copy is being overwritten: it is this sync's until its stream ends
        return DeltaStream(self, manifest, offer, keep=True, prior=prior, framed=offer is not None, transport=transport)

    def _no_delta(self, manifest: Manifest, transport: str) -> str:
        if self.encoding == "full":
            return "sync_encoding=full"
        if transport not in DELTA_TRANSPORTS:
            return f"transport {transport}"
        if transport == "nccl" and self.encoding == "auto":
            why = self._fast_link()
            if why:
                return why
        if not manifest.layout_digest:
            return "the manifest has no layout digest"
        if manifest.total_bytes > self.limit_bytes:
            return f"the export's {manifest.total_bytes >> 20} MiB exceed delta_base_mb={self.limit_bytes >> 20}"
        return ""

    def _fast_link(self) -> str:
        """Why auto on nccl stays full ("": the link is slow enough for deltas)."""
        if not self.link_gbps:
            return "auto on nccl with delta_link_gbps=0"
        if self.link_rate is None:
            return "auto on nccl: no full sync has measured the link yet"
        if self.link_rate * 8e-9 >= self.link_gbps:
            return f"auto on nccl: link measured at {_rate(self.link_rate)} >= delta_link_gbps={self.link_gbps:g}"
        return ""

    def measured(self, rate: float, sync_id: str) -> None:
        """A full nccl sync moved the bus's bytes at `rate` (bytes/s): auto on nccl decides by it from
        the next sync on (the one after a slow measurement keeps its base, so deltas start after it)."""
        self.link_rate = rate
        if self.encoding != "auto" or not self.link_gbps:
            return
        slow = not self._fast_link()
        if slow != self._logged_slow:
            self._logged_slow = slow
            then = (
                "< delta_link_gbps=%g: delta syncs from the next one (which keeps its base for the one after)"
                if slow
                else ">= delta_link_gbps=%g: full syncs, no base kept"
            )
            log.info("auto on nccl: sync %s measured the link at %s " + then, sync_id, _rate(rate), self.link_gbps)

    def check(self, transport: str) -> None:
        """ValueError when this trainer's encoding cannot be carried by `transport`."""
        if self.encoding == "delta" and transport not in DELTA_TRANSPORTS:
            raise ValueError(
                f"sync_encoding=delta is carried by {', '.join(DELTA_TRANSPORTS)} only, not transport={transport}: "
                "set sync_encoding=auto (full on ipc) or sync over tcp or nccl"
            )

    def drop(self) -> None:
        self._bufs, self._sums, self.held, self.streams = {}, {}, None, ()

    def held_bytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())


@dataclass
class DeltaStream:
    """One sync's use of the base: the offer made in PrepareSync and the targets that accepted it."""

    base: DeltaBase
    manifest: Manifest
    #: the DeltaBase offered in PrepareSync, or None (every target in full)
    offer: rollout_pb2.DeltaBase | None
    #: the stream's buckets become the next base
    keep: bool
    accepted: set[str] = field(default_factory=set)
    stored: set[int] = field(default_factory=set)
    #: the checksum of every bucket sent, in manifest order (the pipeline computes none: keep)
    checksums: list[int] = field(default_factory=list)
    #: the syncs whose streams were the base's bytes before this one (DeltaBase.streams)
    prior: tuple[str, ...] = ()
    #: every bucket so far was compared with the base and found unchanged
    unchanged: bool = True
    #: a collective channel frames the buckets: the rollouts expect frames, because a base was
    #: offered in PrepareSync (on a sender rank: rank 0's offer, whatever its own part holds)
    framed: bool = False
    #: the sync's transport (nccl: a full stream measures the link)
    transport: str = ""
    #: every bucket went out (`finish`)
    ok: bool = False

    def channel(self, inner: BucketSender, targets: set[str] | None = None) -> BucketSender:
        """`inner`, sending deltas to the targets that accepted the base and keeping every bucket.
        A collective channel (`BucketSender.collective`: nccl) sends every target the same frames:
        framed once a base was offered (the rollouts expect frames then), and deltas only when all
        of `targets` (the prepared ones) accepted; None: `accepted` was settled so already (a
        sender rank's part, from rank 0's `rank_job`)."""
        if not self.keep:
            return inner
        if inner.collective:
            if not self.framed:
                return _DeltaChannel(inner, self)  # plain dense broadcasts, kept as the next base
            if targets is not None:
                self.broadcast_to(targets)
            return _DeltaChannel(inner.framed(), self)
        if self.accepted:
            inner.delta_targets = set(self.accepted)
        return _DeltaChannel(inner, self)

    def broadcast_to(self, targets) -> None:
        """The stream is a broadcast to `targets` (nccl), which reaches every member alike: deltas
        only when every one of them accepted the base."""
        if self.accepted != set(targets):
            self.accepted.clear()  # someone takes it dense: everyone does

    def encode(self, plan: BucketPlan, dense: torch.Tensor):
        """(the delta of bucket `plan` from the base, or None: send it dense; the checksum of `dense`;
        what `store` keeps of it). Reads the base: call `store` after the send."""
        n, whole = plan.nbytes, plan.nbytes - plan.nbytes % 4
        old, old_sums = self.base._bufs.get(plan.index), self.base._sums.get(plan.index)
        usable = old is not None and old.numel() == n and old.device == dense.device
        incremental = usable and old_sums is not None and n % 4 == 0 and dense.storage_offset() % 4 == 0
        payload = d = None
        if usable:  # compared even when no one takes a delta: whether the base's bytes changed names it
            word = word_bytes(plan)
            d = diff(dense, old, word)  # the one pass over the bucket: encode, sums and store use it
            if self.accepted:
                payload = encode(dense, old, word, d)
        if d is None or d.count():
            self.unchanged = False
        if incremental:
            sums = old_sums + d.sums_change()
        else:
            sums = word_sums(dense[:whole].view(torch.int32))
        return payload, from_sums(sums, dense[whole:], n), (sums, d)

    def store(self, plan: BucketPlan, dense: torch.Tensor, kept, checksum: int) -> None:
        """Bucket `plan` went out: its bytes are the next base."""
        sums, d = kept
        old = self.base._bufs.get(plan.index)
        if old is None or old.numel() != plan.nbytes or old.device != dense.device:
            old = self.base._bufs[plan.index] = torch.empty(plan.nbytes, dtype=torch.uint8, device=dense.device)
            d = None
        if d is None:
            old.copy_(dense)
        else:  # the blocks that differ are known: only they are written
            d.write(old)
        self.base._sums[plan.index] = sums
        self.stored.add(plan.index)
        self.checksums.append(checksum)

    def rank_job(self, broadcast_to=None) -> DeltaRankJob | None:
        """What every sender rank of a multi-sender stream needs to diff and keep its own buckets
        (weightsync/publisher/multisender.py), or None: nothing is kept. `broadcast_to`: the
        targets, when each rank broadcasts to all of them on its group (nccl: `broadcast_to`)."""
        if not self.keep:
            return None
        if broadcast_to is not None:
            self.broadcast_to(broadcast_to)
        return DeltaRankJob(
            base=self.offer.sync_ids[-1] if self.offer is not None and self.offer.sync_ids else "",
            accepted=sorted(self.accepted),
            layout_digest=self.manifest.layout_digest,
            framed=self.framed,
        )

    def senders_kept(self, results) -> None:
        """A multi-sender stream ended: the buckets of each rank that kept all of its own are stored
        (on that rank), and the base is unchanged only if every rank's part is (`finish` follows)."""
        self.base._bufs, self.base._sums = {}, {}  # the ranks hold the bytes: none here to diff against
        for r in results:
            if r.kept:
                self.stored |= {b.index for b in self.manifest.buckets_of(r.rank)}
        self.unchanged = all(r.unchanged for r in results) and bool(results)

    def commit_failed(self) -> None:
        """A rollout sent this sync's buckets in full did not commit them: the base is suspect."""
        if self.keep:
            self.base.drop()

    def streamed(self, nbytes: int, seconds: float, fresh: bool, link_rate: float = 0.0) -> None:
        """The stream put `nbytes` on the bus for each target, waiting `seconds` on it (its sends: the
        link's time that the export did not hide, which is what a delta can save); `link_rate`: the
        bytes/s of its fastest bucket (StreamStats.link_rate), which the link is judged by when given.
        Not the aggregate: a receiver slow to take each bucket (SGLang's hand-over at tp_size 2 was, at
        15 GB/s over NVLink) lengthens the sends as a slow link would, and deltas would not shorten that
        time (the receiver's own apply of a delta costs more), while no bucket crosses a link faster
        than the link. A full nccl stream that went out whole measures the link (DeltaBase.measured);
        not a delta stream (its sends encode too), nor one on a group built in this sync (`fresh`: NCCL
        sets its connections up at the first broadcast, which would read as a slow link and keep a base
        on NVLink). A full stream that keeps its base counts its compare and copy too: a few ms per 3 GB
        on a GPU, slower by far less than the knob separates NVLink from a link between hosts."""
        if self.transport == "nccl" and self.ok and not self.accepted and not fresh and nbytes > 0 and seconds > 0:
            self.base.measured(link_rate or nbytes / seconds, self.manifest.sync_id)

    def finish(self, ok: bool) -> None:
        """The stream ended (`ok`: every bucket went out): the copy is this version's base, or none."""
        self.ok = ok
        if not self.keep:
            return
        if ok and len(self.stored) == len(self.manifest.buckets):
            self.base.held = (self.manifest.version, self.manifest.layout_digest)
            # a stream of exactly the base's bytes leaves a rollout that committed an earlier one
            # on the base too (catch-ups one at a time at one version); any changed byte starts afresh
            same = self.prior if self.unchanged else ()
            self.base.streams = (*same[-(_MAX_STREAMS - 1) :], self.manifest.sync_id)
        else:
            self.base.drop()


def _rate(rate: float) -> str:
    return f"{rate / 1e9:.1f} GB/s ({rate * 8e-9:.0f} Gb/s)"


@dataclass
class DeltaRankJob:
    """A multi-sender stream's delta part, for every sender rank (travels as JSON in the SendJob)."""

    #: the last sync whose stream the base is, per rank 0 ("": no base offered; diff against nothing)
    base: str
    #: the targets that accepted the base: sent deltas where smaller (nccl: all of them, or none)
    accepted: list[str]
    layout_digest: str
    #: (nccl) rank 0 offered a base in PrepareSync, so the rollouts take every rank's buckets as
    #: frames (weightsync/bus/nccl/framed.py): a rank frames them even where its part is of no use
    framed: bool = False


class RankPart:
    """A sender rank's part of the base: the buckets it owns, as its last stream sent them.

    Used as the base only when that stream is the one rank 0 names (DeltaRankJob.base): rank 0
    knows whether every rank kept its part and every rollout committed, a rank alone does not."""

    def __init__(self):
        self.base = DeltaBase("delta", limit_bytes=1 << 62)

    def stream(self, job: DeltaRankJob, mine: Manifest) -> DeltaStream:
        if not job.base or self.base.streams[-1:] != (job.base,):
            self.base.drop()  # not the base rank 0 offered: diff against nothing, keep this stream
        # "tcp": any transport that carries deltas; the rank's channel decides how its buckets go
        s = self.base.begin(replace(mine, layout_digest=job.layout_digest), "tcp")
        if s.offer is not None:
            s.accepted |= set(job.accepted)
        s.framed = job.framed  # what the rollouts expect, which this rank's part does not change
        return s

    def drop(self) -> None:
        self.base.drop()


def rank_part(actor) -> RankPart:
    """This rank's part of the base, kept on the actor across syncs (WeightSource.rank_sync_state)."""
    state = actor.rank_sync_state()
    if state.delta_part is None:
        state.delta_part = RankPart()
    return state.delta_part


class _DeltaChannel(BucketSender):
    """A TcpBucketSender that sends each bucket as a delta where accepted, and keeps it as the next base."""

    def __init__(self, inner: BucketSender, stream: DeltaStream):
        self._inner, self._stream = inner, stream
        self.releases_previous, self.checksums_in_band = inner.releases_previous, inner.checksums_in_band
        self.collective = inner.collective

    # what the stream reads of a channel after its sends is the inner channel's
    @property
    def wire_bytes(self):
        return self._inner.wire_bytes

    @property
    def wire_bytes_sent(self):
        return self._inner.wire_bytes_sent

    @property
    def sent_bytes(self):
        return self._inner.sent_bytes

    @property
    def phase_seconds(self):
        return self._inner.phase_seconds

    def send(self, plan: BucketPlan, buf: torch.Tensor, checksum: int | None) -> None:
        dense = buf[: plan.nbytes]
        payload, checksum, kept = self._stream.encode(plan, dense)
        if payload is not None:
            self._inner.send(plan, buf, checksum, delta=payload)
        else:
            self._inner.send(plan, buf, checksum)
        self._stream.store(plan, dense, kept, checksum)  # after the send: the encode read the old base

    def flush(self) -> None:
        self._inner.flush()

    def failures(self) -> dict[str, str]:
        return self._inner.failures()

    def drop(self, tid: str, why: str) -> bool:
        return self._inner.drop(tid, why)

    def close(self) -> None:
        self._inner.close()
