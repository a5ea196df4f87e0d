"""One pass of a sync over its targets: prepare → stream → commit, then abort whoever failed.

With tcp and ipc, targets succeed or fail individually. With nccl (a group-wide session) a
target that fails the prepare stops the whole pass, and the attempt names the targets of a retry:
every member with a new group when the cached group was refused (a restarted member), else the
members that prepared, which form a group without the one that could not.

When the manifest has several senders (trainer ranks streaming the buckets they own), the stream
phase hands the job to every rank (weightsync.publisher.multisender) instead of streaming from this one,
over tcp (each rank to every rollout's data port) or nccl (each rank on its own group); a rollout
that any sender dropped fails, and a sender that failed as a whole fails every target.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any, Protocol

from weightsync.bus.checksum import InFlightChecksums
from weightsync.bus.errors import TransportError
from weightsync.bus.layout import ManifestCache, compact_proto
from weightsync.bus.pipeline import in_place_views, stream_buckets
from weightsync.bus.plan import Manifest
from weightsync.publisher.delta_sync import DeltaBase
from weightsync.publisher.export_format import ExportFormat
from weightsync.publisher.multisender import SenderResult, stream_from_every_owner
from weightsync.publisher.phases import PhaseClock
from weightsync.publisher.registry import RolloutEntry
from weightsync.publisher.rollout_calls import RolloutCalls
from weightsync.v1 import rollout_pb2, trainer_pb2

log = logging.getLogger(__name__)


class Fleet(Protocol):
    """What an attempt uses of its orchestrator: the actor it exports, the calls that reach a rollout
    (and record a failed one), the long-lived RPC threads and layout cache, and the trainer's identity."""

    actor: Any
    rollouts: RolloutCalls
    pool: futures.Executor
    manifests: ManifestCache
    token: str
    trainer_id: str
    origin: str
    export_format: ExportFormat
    delta: DeltaBase


class SyncAttempt:
    def __init__(
        self,
        fleet: Fleet,
        session,
        manifest: Manifest,
        targets: list[RolloutEntry],
        deadline: float,
        phases: PhaseClock,
        tensors=None,
        allow_rollback: bool = False,
    ):
        """`tensors()`: the exported stream the manifest describes (default: the actor's own);
        `allow_rollback`: this Sync call lets rollouts go back to a lower version."""
        self.fleet, self.session, self.manifest, self.deadline, self.phases = fleet, session, manifest, deadline, phases
        self.rollouts = fleet.rollouts
        self.allow_rollback = allow_rollback
        self.tensors = tensors or (lambda: fleet.actor.export_tensors())
        self.targets = targets
        self.by_id = {e.rollout_id: e for e in targets}
        self.results = {e.rollout_id: trainer_pb2.RolloutSyncResult(rollout_id=e.rollout_id) for e in targets}
        #: rollout_id -> PrepareSync answer of every target still in the sync
        self.prepared: dict[str, rollout_pb2.PrepareSyncResponse] = {}
        #: the targets of a retry ([] for none)
        self.retry: list[RolloutEntry] = []
        #: the retry must stream from global rank 0 alone (a rollout sits on a sending rank's GPU)
        self.funnel_retry = ""
        #: what each sending rank did in the stream (one entry for the single sender)
        self.senders: list[SenderResult] = []
        self._pool = fleet.pool  # long-lived: no threads started per sync
        self._in_place_bufs: list | None = None
        self._in_place_checksums: InFlightChecksums | None = None
        #: the stream's channel, kept open after the stream for targets that commit on it or whose
        #: stream end is awaited after their commit (ipc)
        self._commit_channel = None
        self._on_stream: set[str] = set()
        #: delta or full per target (weightsync/publisher/delta_sync.py); what the stream put on the bus for each
        base = getattr(fleet, "delta", None) or DeltaBase("full")  # a fleet without one syncs in full
        self.delta = base.begin(manifest, session.name)
        self._wire: dict[str, int] = {}
        #: rollout_id -> what the trainer saw, for targets whose stream broke (failed once explained)
        self._stream_failed: dict[str, str] = {}
        #: targets already sent AbortSync (to learn why their stream broke)
        self._aborted: set[str] = set()

    def run(self) -> tuple[dict[str, trainer_pb2.RolloutSyncResult], list[RolloutEntry]]:
        """The results and the targets of a retry ([] for none)."""
        try:
            with self.phases("prepare"):
                # The actor's own storage needs no export: its checksums start on the GPU while the
                # rollouts answer PrepareSync, and the stream reads them when it needs them.
                self.prepare(meanwhile=self._start_in_place)
            with self.phases("stream"):
                checksums = self.stream()
            with self.phases("commit"):
                self.commit(checksums)
                self.abort_failed()
        finally:
            if self._commit_channel is not None:
                self._commit_channel.close()
            if self._in_place_checksums is not None:
                self._in_place_checksums.release()
        return self.results, self.retry

    def _start_in_place(self) -> None:
        t0 = time.perf_counter()
        self._in_place_bufs = None if len(self.manifest.senders) > 1 else self._in_place()
        if self._in_place_bufs is None:
            return
        if self.manifest.checksum_algo:
            self._in_place_checksums = InFlightChecksums(in_place_views(self.manifest, self._in_place_bufs))
        self.phases.add("prepare.in_place", time.perf_counter() - t0)  # a part of prepare

    def _left(self) -> float:
        return max(0.001, self.deadline - time.monotonic())

    def _fail(self, rid: str, reason: str, err: str) -> None:
        self.rollouts.fail(self.results[rid], self.by_id[rid], reason, err)

    # ---- prepare ----------------------------------------------------------------------------
    def prepare(self, meanwhile: Callable[[], None] | None = None) -> None:
        """PrepareSync on every target; keeps those that prepared and whose answer the session accepts.

        `meanwhile` runs once the requests are out, before their answers are read: the trainer's
        own work for the sync overlaps the rollouts'."""
        answers = self._prepare_calls(meanwhile)
        for e in self.targets:
            resp, err = answers[e.rollout_id]
            err = err or self.session.accept(e, resp)
            if err and self.session.sender_gpu_clash:
                r = self.results[e.rollout_id]  # retried through the funnel: not a failure of this rollout
                r.ok, r.error = False, f"prepare: {err}"
            elif err:
                self._fail(e.rollout_id, "prepare_failed", f"prepare: {err}")
            else:
                self.prepared[e.rollout_id] = resp
                if resp.delta_accepted and self.delta.offer is not None:
                    self.delta.accepted.add(e.rollout_id)
        if self.session.sender_gpu_clash:
            self.funnel_retry = self.session.sender_gpu_clash
        if self.session.group_wide and len(self.prepared) < len(self.targets):
            self._stop_group()

    def _prepare_calls(
        self, meanwhile: Callable[[], None] | None
    ) -> dict[str, tuple[rollout_pb2.PrepareSyncResponse | None, str]]:
        """PrepareSync on every target at once: rollout_id -> (answer, error).

        A target that holds the layout gets its digest only (ManifestCache); the others, and any
        that answers `manifest_needed` (it restarted, or dropped the layout), the full manifest.
        """
        cache, digest = self.fleet.manifests, self.manifest.layout_digest
        # (a manifest planned without ManifestCache has no digest: it always goes in full)
        compact, full = (compact_proto(self.manifest) if digest else None), None
        out: dict[str, tuple[rollout_pb2.PrepareSyncResponse | None, str]] = {}
        pending = list(self.targets)
        while pending:
            calls = []
            for e in pending:
                send_full = compact is None or not cache.holds(e, digest)
                if send_full and full is None:
                    full = cache.full_proto(self.manifest)
                req = rollout_pb2.PrepareSyncRequest(
                    manifest=full if send_full else compact,
                    timeout_seconds=self._left(),
                    transport=self.session.spec_for(e),
                    trainer_id=self.fleet.trainer_id,
                    allow_rollback=self.allow_rollback,
                    delta_base=self.delta.offer,
                )
                calls.append((e, send_full, req))
            pending = []
            if meanwhile is not None:
                futs = [self._pool.submit(self.rollouts.call, e, "PrepareSync", req) for e, _, req in calls]
                run, meanwhile = meanwhile, None
                try:
                    run()
                except BaseException:  # the requests already out end before the failure is raised
                    futures.wait(futs, timeout=self._left())
                    raise
                answers = [f.result() for f in futs]
            else:
                answers = self._on_each(lambda c: self.rollouts.call(c[0], "PrepareSync", c[2]), calls)
            for (e, sent_full, _), (resp, err) in zip(calls, answers):
                if not err and resp.manifest_needed:
                    cache.forget(e)
                    if not sent_full:
                        pending.append(e)  # once more, in full (then it holds the layout, or it errs)
                        continue
                    err = "the rollout asked for the full manifest it was just sent"
                if err:
                    cache.forget(e)
                else:
                    cache.learned(e, digest)
                out[e.rollout_id] = (resp, err)
        if meanwhile is not None:  # no target to prepare
            meanwhile()
        return out

    def _stop_group(self) -> None:
        """A group-wide session cannot start without every member: fail (or retry) the ones that prepared."""
        if self.funnel_retry:
            self.retry = list(self.targets)  # all of them, in one group of rank 0
        elif self.session.reused:
            self.retry = list(self.targets)  # a member that restarted no longer holds the cached group
        elif self.prepared:
            # One rollout that cannot take part (unreachable, no GPU, a GPU already in the
            # group) must not hold back the others: they form a group without it.
            self.retry = [self.by_id[rid] for rid in self.prepared]
        bad = [r for r in self.results.values() if r.rollout_id not in self.prepared]
        why = f"{bad[0].rollout_id}: {bad[0].error}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
        for rid in self.prepared:
            msg = f"{self.session.name}: not started: every member of the group must prepare, and {why}"
            if self.retry:  # superseded by the retry's result: not a failure of this rollout
                self.results[rid].ok, self.results[rid].error = False, msg
            else:
                self._fail(rid, "transport", msg)
        self.prepared.clear()

    # ---- stream -----------------------------------------------------------------------------
    def stream(self) -> list[int]:
        """Every bucket to every prepared target; returns the bucket checksums ([] if nothing was streamed)."""
        checksums: list[int] = []
        ok, reason = False, "no target prepared"
        multi = len(self.manifest.senders) > 1
        in_place = self._in_place_bufs if self.prepared else None
        # Sending the actor's own storage needs no export pass (nor, then, a drain of one); with
        # several senders every rank exports its own tensors (weightsync/publisher/multisender.py).
        export = iter(self.tensors()) if self.prepared and in_place is None and not multi else iter(())
        streamed = list(self.prepared)
        if self.prepared:
            try:
                checksums = self._send_from_every_owner() if multi else self._send(export, in_place)
                ok = True
            except Exception as exc:  # any failure to move bytes fails the targets, never the RPC
                reason = f"stream: {exc}"
                if not isinstance(exc, (OSError, TimeoutError, ValueError, RuntimeError)):
                    log.exception("sync %s: unexpected stream failure", self.manifest.sync_id)
                for rid in list(self.prepared):
                    self._stream_failed[rid] = f"{self.session.name} {reason}"
                self.prepared.clear()
        self.session.finish(ok, reason)
        self.delta.finish(ok)
        for rid in streamed:
            r = self.results[rid]
            r.encoding = "delta" if rid in self.delta.accepted else "full"
            r.wire_bytes = self._wire.get(rid, self.manifest.total_bytes if ok else 0)
        self._explain_stream_failures()
        # Multi-rank actors run collectives inside the exporter: drain it so every rank finishes.
        try:
            for _ in export:
                pass
        except Exception as exc:
            if ok:  # a stream that went through read the export to its end: nothing may fail here
                raise
            # The exporter can still fail after a failed stream, e.g. on non-finite FP8 weights,
            # which it reports at its end: raising would skip the aborts below, so it joins the
            # failed targets' errors.
            log.error("sync %s: the export failed after the stream did: %s", self.manifest.sync_id, exc)
            for rid in streamed:
                self.results[rid].error += f"; the export failed too: {exc}"
        return checksums

    def _in_place(self):
        """The actor's own storage as this manifest's buckets (no pack copy), or None.

        Only on a GPU: there the copy is what a sync costs; a CPU actor's tensors stay as they are.
        """
        flat = getattr(self.fleet.actor, "flat_buckets", None)
        # a quantized export is computed per sync: the actor's storage is not what travels
        if flat is None or self.session.device.type != "cuda" or self.manifest.quantization is not None:
            return None
        try:
            buffers = flat(self.manifest)
        except Exception:  # an optimisation only: every parameter still holds its value; pack instead
            log.exception(
                "sync %s: the actor could not lay its parameters out as the buckets; packing them",
                self.manifest.sync_id,
            )
            return None
        if buffers is not None:
            self.session.use_in_place(buffers)
        return buffers

    def _send_from_every_owner(self) -> list[int]:
        actor, sync_id = self.fleet.actor, self.manifest.sync_id
        flags = getattr(actor, "stream_flags", None)  # how rank 0 tells every sender to stop
        raise_flag = None if flags is None else (lambda reason: flags.raise_flag(sync_id, reason))
        targets, groups, period = self.session.owner_streams(
            {rid: self.by_id[rid] for rid in self.prepared}, self._left(), raise_flag
        )
        fmt = self.fleet.export_format
        out = stream_from_every_owner(
            actor,
            self.manifest,
            targets,
            self.fleet.token,
            self._left(),
            nccl_groups=groups,
            export_dtype=fmt.name if fmt.quantization else "",
            watch_period=period,
        )
        self.senders = out.senders
        for rid, err in out.failures.items():
            if rid in self.prepared:
                self.prepared.pop(rid)
                self._stream_failed[rid] = err
        if out.error:
            raise TransportError(out.error)
        return out.checksums

    def _send(self, export, in_place) -> list[int]:
        channel = self.delta.channel(self.session.open({rid: self.by_id[rid] for rid in self.prepared}, self._left()))
        # A target on the sync link commits there (the cheapest round trip); one without a link,
        # on its IpcBuckets stream when it offered that; the rest call CommitSync.
        on_stream = [rid for rid, resp in self.prepared.items() if resp.commit_on_stream and not self._linked(rid)]
        if on_stream and self.session.commit_on_stream:
            channel.commit_on_stream(on_stream)  # saves each of them the CommitSync round trip
            self._commit_channel, self._on_stream = channel, set(on_stream)
        linked = [rid for rid in self.prepared if self._linked(rid)]
        if linked and self.session.commit_on_stream:
            # their streams' ends need not hold up the stream phase: awaited when the channel closes
            channel.commit_elsewhere(linked)
            self._commit_channel = channel
        t0 = time.perf_counter()
        sender = SenderResult(
            rank=0, buckets=len(self.manifest.buckets), bytes=sum(b.tensor_bytes for b in self.manifest.buckets)
        )
        self.senders = [sender]
        try:
            stats = stream_buckets(
                self.manifest,
                export,
                channel,
                device=self.session.device,
                timeout=self._left(),
                buffers=self.session.buffers,
                in_place=in_place,
                in_place_checksums=self._in_place_checksums if in_place is not None else None,
                with_checksums=not self.delta.keep,  # a sync that keeps its buckets sums them as it diffs them
            )
            # parts of the stream phase, overlapping the sends: the actor's export (gather, convert)
            # and all the trainer's work per bucket (export + pack + checksum)
            self.phases.add("stream.export", stats.export_seconds)
            self.phases.add("stream.pack", stats.pack_seconds)
            sender.peak_buffer_bytes = stats.peak_buffer_bytes
            return self.delta.checksums if self.delta.keep else stats.checksums
        except Exception as exc:
            sender.error = str(exc)
            raise
        finally:
            sender.seconds = time.perf_counter() - t0
            sender.forwarded_bytes = int(getattr(self.fleet.actor, "export_stats", {}).get("forwarded_bytes", 0))
            self._wire = dict(getattr(channel, "wire_bytes", {}))
            for rid, err in channel.failures().items():
                if rid in self.prepared:
                    self.prepared.pop(rid)
                    self._stream_failed[rid] = err
            if channel is not self._commit_channel:
                channel.close()

    def _explain_stream_failures(self) -> None:
        """Fail the targets whose stream broke, with the rollout's own reason when it had one.

        A rollout that finds a bucket corrupted (DATA_LOSS) aborts the sync and closes its stream:
        the trainer sees only a broken pipe. AbortSync (due to them anyway) answers why, so the
        report, wsctl and the failure metric say DATA_LOSS, not a transport error."""
        failed, self._stream_failed = self._stream_failed, {}
        if not failed:
            return
        req = self._abort_request()
        rids = [rid for rid in failed if not self.rollouts.gone(self.by_id[rid])]
        answers = dict(zip(rids, self._on_each(lambda r: self.rollouts.call(self.by_id[r], "AbortSync", req), rids)))
        self._aborted.update(rids)  # abort_failed need not abort them again
        for rid, err in failed.items():
            resp, _ = answers.get(rid, (None, ""))
            why = resp.aborted_reason if resp is not None else ""
            if why:
                err = f"{why} (the rollout aborted the sync; the trainer's stream saw: {err})"
            self._fail(rid, "data_loss" if why.startswith("DATA_LOSS") else "transport", err)
            if why.startswith("DATA_LOSS") and rid not in self.delta.accepted:
                self.delta.commit_failed()  # a dense bucket refused: the trainer's base is suspect

    def _abort_request(self) -> rollout_pb2.AbortSyncRequest:
        return rollout_pb2.AbortSyncRequest(
            sync_id=self.manifest.sync_id, reason="trainer aborted the sync", trainer_id=self.fleet.trainer_id
        )

    # ---- commit / abort ---------------------------------------------------------------------
    def commit(self, checksums: list[int]) -> None:
        """CommitSync on every target still in the sync."""
        req = rollout_pb2.CommitSyncRequest(
            sync_id=self.manifest.sync_id, version=self.manifest.version, trainer_id=self.fleet.trainer_id
        )
        for i, c in enumerate(checksums):
            req.checksums.add(index=i, checksum=c)
        rids = list(self.prepared)
        for rid, (resp, err) in zip(rids, self._on_each(lambda r: self._commit_one(r, req), rids)):
            e, r = self.by_id[rid], self.results[rid]
            if err:
                if err.startswith("DATA_LOSS"):  # the rollout's checksums found corruption (at commit on a GPU)
                    self._fail(rid, "data_loss", f"{err} (reported at commit)")
                else:
                    self._fail(rid, "commit_failed", f"commit: {err}")
                if rid not in self.delta.accepted:
                    self.delta.commit_failed()  # a dense bucket refused: the trainer's base is suspect
            else:
                r.ok, r.version = True, resp.version
                e.version, e.state, e.reachable, e.last_error = resp.version, rollout_pb2.SERVING, True, ""
                e.origin = self.fleet.origin

    def _commit_one(self, rid: str, req: rollout_pb2.CommitSyncRequest):
        if rid in self._on_stream:
            return self._commit_channel.commit(rid, req, timeout=self.rollouts.rpc_timeout)
        return self.rollouts.call(self.by_id[rid], "CommitSync", req)

    def _linked(self, rid: str) -> bool:
        return self.rollouts.link_of(self.by_id[rid]) is not None

    def abort_failed(self) -> None:
        """AbortSync on every target that did not commit, so none is left holding a prepared sync.

        Not on one that went silent: the call would wait for it, holding this Sync; its own timer
        (timeout_seconds) aborts what it prepared, and the catch-up sync supersedes it."""
        req = self._abort_request()
        failed = [
            self.by_id[r.rollout_id]
            for r in self.results.values()
            if not r.ok and r.rollout_id not in self._aborted and not self.rollouts.gone(self.by_id[r.rollout_id])
        ]
        self._on_each(lambda e: self.rollouts.call(e, "AbortSync", req), failed)

    def _on_each(self, fn: Callable, items: list) -> list:
        """[fn(x) for x in items], all at once: the first on this thread, the others on the RPC
        pool's (a sync to one rollout hands nothing to another thread and back)."""
        futs = [self._pool.submit(fn, x) for x in items[1:]]
        try:
            first = [fn(items[0])] if items else []
        except BaseException:  # the calls already out end before the failure is raised
            futures.wait(futs, timeout=self._left())
            raise
        return first + [f.result() for f in futs]
