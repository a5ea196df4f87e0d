"""The stream phase of a sync attempt: every bucket to every target that prepared.

From one sender (global rank 0: packed buckets, or the actor's own storage on a GPU, sent without a
pack copy) or, when the manifest has several senders, from every trainer rank that owns tensors
(weightsync.publisher.multisender). A target whose stream broke leaves the attempt; AbortSync asks
it why, so a bucket the rollout found corrupted is reported as DATA_LOSS, not as the broken pipe the
trainer saw. Targets that commit on the stream's channel (ipc) or whose stream end is awaited after
their commit (sync link) keep the channel open past this phase (`commit_channel`).

A target that goes silent mid-stream (stopped, hung: its sync link answers no ping for
liveness_timeout_s, weightsync.publisher.stream_liveness) is dropped from the channel while the others
stream on: failed `silent`, left on its version (stale) until a later sync, and never sent AbortSync
(the call would only wait on it): what it received is never committed, since no CommitSync reaches
it, and its own prepare timer aborts it. A channel that can drop one target (tcp, and every sending
rank's over multi-sender tcp) does so and the others stream on; a collective (nccl) cuts the member
out by ending the stream, and its live members are restarted without it (weightsync.publisher.stream_cut;
docs/architecture.md, "Stragglers").
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from weightsync.bus.copy.checksum import InFlightChecksums
from weightsync.bus.errors import TransportError
from weightsync.bus.pipeline import in_place_views, stream_buckets
from weightsync.obs import tracing
from weightsync.obs.bucket_groups import BucketGroups
from weightsync.publisher.early_commit import EarlyCommits
from weightsync.publisher.multisender import SenderResult, stream_from_every_owner
from weightsync.publisher.phases import PhaseClock
from weightsync.publisher.route import Route, pick
from weightsync.publisher.stream_cut import owners_drop, restart_live, stream_drop
from weightsync.publisher.stream_liveness import StreamLiveness

log = logging.getLogger(__name__)


class Attempt(Protocol):
    """What the stream phase uses of its attempt (weightsync.publisher.attempt.SyncAttempt)."""

    fleet: Any
    session: Any
    manifest: Any
    phases: PhaseClock
    tensors: Callable
    prepared: dict
    results: dict
    by_id: dict
    delta: Any
    rollouts: Any
    aborted: set[str]

    def left(self) -> float: ...
    def fail(self, rid: str, reason: str, err: str) -> None: ...
    def gone(self, rid: str) -> bool: ...
    def linked(self, rid: str) -> bool: ...
    def on_each(self, fn: Callable, items: list) -> list: ...
    def abort_request(self): ...
    def commit_request(self, checksums: list[int]): ...


class StreamPhase:
    def __init__(self, attempt: Attempt):
        self.attempt = attempt
        self.fleet, self.session, self.manifest = attempt.fleet, attempt.session, attempt.manifest
        #: what each sending rank did in the stream (one entry for the single sender)
        self.senders: list[SenderResult] = []
        #: the actor's own storage as the buckets (GPU only), and their checksums started during prepare
        self.in_place_bufs: list | None = None
        #: the actor left its block-FP8 slots unwritten at prepare (the sync was expected to write the
        #: weights into the engine from its parameters): the stream writes them if it does not
        self.fp8_deferred = False
        self.in_place_checksums: InFlightChecksums | None = None
        #: the path this attempt's stream takes (weightsync/publisher/route.py), picked once prepare answered
        self.route: Route | None = None
        #: the stream's channel, kept open after the stream for targets that commit on it or whose
        #: stream end is awaited after their commit (ipc)
        self.commit_channel = None
        self.on_stream: set[str] = set()
        #: rollout_id -> bytes the stream put on the bus for it (delta or full)
        self._wire: dict[str, int] = {}
        #: rollout_id -> what the trainer saw, for targets whose stream broke (failed once explained)
        self._stream_failed: dict[str, str] = {}
        #: bytes handed to the bus so far (sync progress)
        self.bytes_sent = 0
        #: rollout_id -> seconds its link was silent when it was dropped from the stream
        self.silent: dict[str, float] = {}
        #: bytes the stream put on the bus for each target, once it went out to every one of them (else 0)
        self.bus_bytes = 0
        #: seconds the stream waited on the bus (the sends; with several senders, the longest wait)
        self.send_seconds = 0.0
        #: bytes/s of its fastest bucket (StreamStats.link_rate; with several senders, the slowest rank's)
        self.link_rate = 0.0
        #: CommitSync sent as the last bucket went out (nccl, tcp: targets on a sync link)
        self.early = EarlyCommits(attempt)
        self._watch: StreamLiveness | None = None

    def start_in_place(self) -> None:
        """Lay the actor's own storage out as the buckets, and start their checksums (runs during prepare)."""
        t0 = time.perf_counter()
        self.in_place_bufs = None if len(self.manifest.senders) > 1 else self._in_place()
        if self.in_place_bufs is None:
            return
        # a trainer that writes into the engine sums as it writes: no checksum pass of its own
        # (if the rollout does not offer it after all, the stream starts the sums then)
        if self.manifest.checksum_algo and not self.session.expects_channel_sums:
            self._start_checksums(self.in_place_bufs)
        self.attempt.phases.add("prepare.in_place", time.perf_counter() - t0)  # a part of prepare

    def _start_checksums(self, in_place) -> None:
        """Start the checksums of the actor's own buckets. An actor whose kernels summed some of the words
        as they wrote them (megatron's FP8 quantizer: its e4m3 and scale slots) says so: only the other
        words are read here."""
        self.in_place_checksums = InFlightChecksums(
            in_place_views(self.manifest, in_place), known=self.fleet.actor.flat_known_sums()
        )

    def close(self) -> None:
        # a commit sent early whose answer no phase read (the attempt failed in between): the link is freed
        self.early.settle("the sync attempt ended before its commit phase")
        if self.commit_channel is not None:
            self.commit_channel.close()
        if self.in_place_checksums is not None:
            self.in_place_checksums.release()

    def run(self) -> list[int]:
        """Every bucket to every prepared target; returns the bucket checksums ([] if nothing was streamed)."""
        a = self.attempt
        checksums: list[int] = []
        ok, reason = False, "no target prepared"
        self.route = self._pick_route()
        log.debug("sync %s: route %s", self.manifest.sync_id, self.route)  # INFO in the sync's summary line
        multi = self.route.multi_sender
        in_place = self.in_place_bufs if a.prepared else None
        # Sending the actor's own storage needs no export pass (nor, then, a drain of one); with
        # several senders every rank exports its own tensors (weightsync/publisher/multisender.py).
        export = iter(a.tensors()) if a.prepared and in_place is None and not multi else iter(())
        streamed = list(a.prepared)
        answered = dict(a.prepared)
        if a.prepared:
            try:
                checksums = self._send_from_every_owner() if multi else self._send(export, in_place)
                ok = True
            except Exception as exc:  # any failure to move bytes fails the targets, never the RPC
                reason = f"stream: {exc}"
                if not isinstance(exc, (OSError, TimeoutError, ValueError, RuntimeError)):
                    log.exception("sync %s: unexpected stream failure", self.manifest.sync_id)
                for rid in list(a.prepared):
                    self._stream_failed[rid] = f"{self.session.name} {reason}"
                a.prepared.clear()
        self.early.keep_committed(self._stream_failed, a.prepared, answered)
        self.session.finish(ok, reason)
        a.delta.finish(ok)
        for rid in streamed:
            r = a.results[rid]
            r.encoding = "delta" if rid in a.delta.accepted else "full"
            r.wire_bytes = self._wire.get(rid, self.manifest.total_bytes if ok else 0)
        if ok and not self._stream_failed:
            self.bus_bytes = max(a.results[rid].wire_bytes for rid in streamed)
        self._explain_stream_failures()
        # Multi-rank actors run collectives inside the exporter: drain it so every rank finishes.
        try:
            for _ in export:
                pass
        except Exception as exc:
            if ok:  # a stream that went through read the export to its end: nothing may fail here
                raise
            # The exporter can still fail after a failed stream, e.g. on non-finite FP8 weights,
            # which it reports at its end: raising would skip the aborts that follow, so it joins the
            # failed targets' errors.
            log.error("sync %s: the export failed after the stream did: %s", self.manifest.sync_id, exc)
            for rid in streamed:
                a.results[rid].error += f"; the export failed too: {exc}"
        return checksums

    def _pick_route(self) -> Route:
        """This attempt's route, once prepare answered (who writes, who takes deltas): what the stream
        dispatches on. A broadcast reaches every member alike, so a group-wide session's deltas go to
        every target or none, settled here (DeltaStream.broadcast_to)."""
        a = self.attempt
        if self.session.group_wide and a.delta.keep:
            a.delta.broadcast_to(a.prepared)
        return pick(self.session, self.manifest, self.fleet.export_format.name, a.prepared, a.delta.accepted)

    def _in_place(self):
        """The actor's own storage as this manifest's buckets (no pack copy), or None.

        Only on a GPU: there the copy is what a sync costs; a CPU actor's tensors stay as they are.
        """
        actor = self.fleet.actor
        # a quantized layout too: an actor that quantizes into its buckets says so by returning them
        # (megatron's flat export, one launch per bucket); the others return None and the sync packs
        if self.session.device.type != "cuda":
            return None
        # a block-FP8 sync expected to be written into the engine (its one target offered a table last
        # time): the writer dequantizes the weights straight from the parameters (fp8_trainer_writes.py),
        # so the actor does not quantize them into its buckets first; `_hand_fp8` does if it must
        defer = (
            self.manifest.quantization is not None
            and self.session.expects_channel_sums
            and actor.fp8_weights_from_parameters
        )
        try:
            buffers = actor.flat_buckets(self.manifest, quantize=False) if defer else actor.flat_buckets(self.manifest)
        except Exception:  # an optimisation only: every parameter still holds its value; pack instead
            log.exception(
                "sync %s: the actor could not lay its parameters out as the buckets; packing them",
                self.manifest.sync_id,
            )
            return None
        if buffers is not None:
            self.session.use_in_place(buffers)
            self.fp8_deferred = defer
        return buffers

    def _send_from_every_owner(self) -> list[int]:
        a, actor, sync_id = self.attempt, self.fleet.actor, self.manifest.sync_id
        flags = actor.stream_flags  # how rank 0 tells every sender to stop
        raise_flag = None if flags is None else (lambda reason: flags.raise_flag(sync_id, reason))
        targets, groups, period = self.session.owner_streams(
            {rid: a.by_id[rid] for rid in a.prepared}, a.left(), raise_flag
        )
        fmt = self.fleet.export_format
        with self._liveness(owners_drop(self.session, flags, sync_id)):
            out = stream_from_every_owner(
                actor,
                self.manifest,
                targets,
                self.fleet.token,
                a.left(),
                nccl_groups=groups,
                export_dtype=fmt.name if fmt.quantization else "",
                watch_period=period,
                # a broadcast on each sender's group (nccl) reaches every target alike: deltas for all or none
                delta=a.delta.rank_job(set(a.prepared) if self.session.group_wide else None),
            )
        self.senders = out.senders
        self.bytes_sent = sum(s.bytes for s in out.senders)
        self.send_seconds = max((s.send_seconds for s in out.senders), default=0.0)  # they send at once
        self.link_rate = min((s.link_rate for s in out.senders if s.link_rate > 0), default=0.0)
        if a.delta.keep:
            a.delta.senders_kept(out.senders)
        for s in out.senders:
            # a framed broadcast counts its bytes once, for every member of the sender's group
            sent = s.wire_bytes if s.broadcast_bytes is None else dict.fromkeys(a.prepared, s.broadcast_bytes)
            for rid, n in sent.items():
                self._wire[rid] = self._wire.get(rid, 0) + n
        for rid, err in out.failures.items():
            if rid in a.prepared:
                a.prepared.pop(rid)
                self._stream_failed[rid] = err
        if out.error:
            raise TransportError(out.error)
        return out.checksums

    def _send(self, export, in_place) -> list[int]:
        a = self.attempt
        opened = self.session.open({rid: a.by_id[rid] for rid in a.prepared}, a.left())
        try:
            self._hand_fp8(opened, in_place)
        except Exception:
            opened.close()
            raise
        channel = a.delta.channel(opened, set(a.prepared))
        # A target on the sync link commits there (the cheapest round trip); one without a link,
        # on its IpcBuckets stream when it offered that; the rest call CommitSync.
        on_stream = [rid for rid, resp in a.prepared.items() if resp.commit_on_stream and not a.linked(rid)]
        if on_stream and self.session.commit_on_stream:
            channel.commit_on_stream(on_stream)  # saves each of them the CommitSync round trip
            self.commit_channel, self.on_stream = channel, set(on_stream)
        linked = [rid for rid in a.prepared if a.linked(rid)]
        if linked and self.session.commit_on_stream:
            # their streams' ends need not hold up the stream phase: awaited when the channel closes
            channel.commit_elsewhere(linked)
            self.commit_channel = channel
        early = None
        if linked and not self.session.commit_on_stream:
            early = functools.partial(self._commit_early, channel)
        t0 = time.perf_counter()
        # (per layout, not per tensor: a steady-state sync walks no tensor list)
        sender = SenderResult(rank=0, buckets=len(self.manifest.buckets), bytes=self.manifest.tensor_bytes)
        self.senders = [sender]
        # tracing on: the stream's bucket groups, for spans under its sender's (off: nothing is called)
        groups = BucketGroups([b.index for b in self.manifest.buckets]) if tracing.enabled() else None
        try:
            with self._liveness(stream_drop(self.session, channel), channel) as self._watch:
                stats = stream_buckets(
                    self.manifest,
                    export,
                    channel,
                    device=self.session.device,
                    timeout=a.left(),
                    buffers=self.session.buffers,
                    in_place=in_place,
                    in_place_checksums=self.in_place_checksums if in_place is not None else None,
                    with_checksums=not a.delta.keep,  # a sync that keeps its buckets sums them as it diffs them
                    on_sent=self._sent if groups is None else self._sent_and_grouped(groups),
                    on_last_sent=early,
                )
            # parts of the stream phase, overlapping the sends: the actor's export (gather, convert)
            # and all the trainer's work per bucket (export + pack + checksum)
            a.phases.add("stream.export", stats.export_seconds)
            a.phases.add("stream.pack", stats.pack_seconds)
            if self.route.trainer_writes:
                # the trainer wrote into the engine: its launches and final sync
                a.phases.add("stream.trainer_writes", stats.send_seconds)
                for part, seconds in channel.phase_seconds.items():
                    a.phases.add(f"stream.trainer_writes.{part}", seconds)  # parts of the above
            sender.peak_buffer_bytes = stats.peak_buffer_bytes
            sender.send_seconds = self.send_seconds = stats.send_seconds
            sender.link_rate = self.link_rate = stats.link_rate
            return a.delta.checksums if a.delta.keep else stats.checksums
        except Exception as exc:
            sender.error = str(exc)
            self.early.settle(str(exc))  # before any AbortSync on their links
            raise
        finally:
            self._watch = None
            sender.seconds = time.perf_counter() - t0
            if groups is not None:
                sender.groups = groups.close()
            sender.forwarded_bytes = int(self.fleet.actor.export_stats.get("forwarded_bytes", 0))
            self._wire = dict(channel.wire_bytes)
            framed = channel.wire_bytes_sent  # a framed collective: every member took it all
            if framed is not None:
                self._wire = dict.fromkeys(a.prepared, framed)
            for rid, err in channel.failures().items():
                if rid in a.prepared:
                    a.prepared.pop(rid)
                    self._stream_failed[rid] = err
            # a target that left the stream after its commit went out: its link is freed before any AbortSync
            self.early.settle("its stream failed", set(self._stream_failed))
            if channel is not self.commit_channel:
                channel.close()

    def _commit_early(self, channel, checksums: list[int]) -> None:
        """CommitSync now that the last bucket went out (weightsync.publisher.early_commit)."""
        self.early.last_sent(channel, checksums, self.silent, self._watch, self.session)

    def _hand_fp8(self, channel, in_place) -> None:
        """A block-FP8 sync from the actor's own buckets: a channel that writes into the engine takes
        the FP8 weights from the parameters (`write_fp8_from`: one fused launch, no quantize pass);
        otherwise buckets whose FP8 slots were left unwritten at prepare (`fp8_deferred`) are quantized
        now, and their checksums started, as a prepare that expected no writes would have. A weight
        that is not finite fails the stream naming it."""
        if in_place is None or self.manifest.quantization is None:
            return
        actor = self.fleet.actor
        if actor.fp8_weights_from_parameters and channel.write_fp8_from(actor.flat_fp8_weights()):
            return
        if not self.fp8_deferred:
            return
        t0 = time.perf_counter()
        err = actor.flat_quantize()
        if err is not None:
            raise ValueError(f"the trainer's weights are not finite: {err}")
        if self.manifest.checksum_algo and not channel.computes_checksums:
            self._start_checksums(in_place)
        self.attempt.phases.add("stream.quantize", time.perf_counter() - t0)

    def _liveness(self, drop, channel=None) -> StreamLiveness:
        """The watch that hands `drop` (weightsync.publisher.stream_cut) the targets whose sync links fall
        silent mid-stream."""
        a = self.attempt
        timeout = a.rollouts.liveness_timeout  # None: no liveness signal to go by
        if drop is None:
            timeout = None  # it keeps every target to the end (the deadline bounds it): no thread, no pings
        links = {}
        for rid in a.prepared if timeout else ():
            link = a.rollouts.link_of(a.by_id[rid])
            if link is not None:
                links[rid] = link
        sent = channel.sent_bytes if channel is not None else None  # receive progress, where counted (tcp)
        return StreamLiveness(
            links,
            timeout or 1.0,
            lambda rid, silent_s: self._drop_silent(drop, rid, silent_s),
            progress=sent.get if sent is not None else None,
        )

    def _drop_silent(self, drop, rid: str, silent_s: float) -> None:
        """Take `rid` out of the stream (on the watch's thread): the others' sends go on without it."""
        timeout = self.attempt.rollouts.liveness_timeout
        why = (
            f"stream: UNAVAILABLE: the rollout went silent mid-stream (its sync link answered no liveness ping "
            f"for {silent_s:.2f}s; liveness_timeout_s={timeout:g}): stopped, hung or unreachable"
        )
        if drop(rid, why):  # a stream that cannot drop one target keeps it (the deadline bounds it)
            self.silent[rid] = silent_s
            log.warning("sync %s: %s dropped from the stream: %s", self.manifest.sync_id, rid, why)

    def _sent_and_grouped(self, groups: BucketGroups) -> Callable[[int], None]:
        def sent(nbytes: int) -> None:
            self._sent(nbytes)
            groups.sent(nbytes)

        return sent

    def _sent(self, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.attempt.phases.progress(bytes_sent=self.bytes_sent)

    def _explain_stream_failures(self) -> None:
        """Fail the targets whose stream broke, with the rollout's own reason when it had one.

        A rollout that finds a bucket corrupted (DATA_LOSS) aborts the sync and closes its stream:
        the trainer sees only a broken pipe. AbortSync (due to them anyway) answers why, so the
        report, wsctl and the failure metric say DATA_LOSS, not a transport error."""
        a = self.attempt
        failed, self._stream_failed = self._stream_failed, {}
        # a collective whose members were cut (silent, dead): the live ones are restarted without them
        failed = restart_live(a, self.session, failed)
        for rid in [rid for rid in failed if rid in self.silent]:
            # gone: AbortSync would only wait on it (its own prepare timer aborts what it received)
            a.dropped[rid] = self.silent[rid]
            e = a.by_id[rid]
            e.reachable = False
            a.fail(
                rid,
                "silent",
                f"{failed.pop(rid)}: dropped from this sync; it stays at version {e.version} (stale) until a later "
                "sync, and what it received is never committed",
            )
        if not failed:
            return
        req = a.abort_request()
        rids = [rid for rid in failed if not a.gone(rid)]
        answers = dict(zip(rids, a.on_each(lambda r: a.rollouts.call(a.by_id[r], "AbortSync", req), rids)))
        a.aborted.update(rids)  # abort_failed need not abort them again
        for rid, err in failed.items():
            resp, _ = answers.get(rid, (None, ""))
            why = resp.aborted_reason if resp is not None else ""
            if why:
                err = f"{why} (the rollout aborted the sync; the trainer's stream saw: {err})"
            a.fail(rid, "data_loss" if why.startswith("DATA_LOSS") else "transport", err)
            if why.startswith("DATA_LOSS") and rid not in a.delta.accepted:
                a.delta.commit_failed()  # a dense bucket refused: the trainer's base is suspect
