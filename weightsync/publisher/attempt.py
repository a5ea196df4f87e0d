"""One pass of a sync over its targets: prepare → stream → commit, then abort whoever failed.

With tcp and ipc, targets succeed or fail individually. With nccl (a group-wide session) a
target that fails the prepare stops the whole pass, and the attempt names the targets of a retry:
every member with a new group when the cached group was refused (a restarted member), else the
members that prepared, which form a group without the one that could not. A member cut out
mid-stream (silent, dead) makes the live members the retry's targets too (weightsync.publisher.stream_cut).

The stream phase is weightsync.publisher.stream_phase. Prepare and commit go to every target at
once and never wait long on one that went silent (weightsync.publisher.straggler): it is dropped from
the attempt once the others answered and a short grace passed, reported failed (reason `silent`) and
left on its version until a later sync catches it up; its late answer to a prepare is superseded by an
AbortSync of this sync, so what it prepared never commits.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any, Protocol

from weightsync.bus.layout import ManifestCache, compact_proto
from weightsync.bus.plan import Manifest
from weightsync.obs import tracing
from weightsync.publisher.delta_sync import DeltaBase
from weightsync.publisher.export_format import ExportFormat
from weightsync.publisher.phases import PhaseClock
from weightsync.publisher.registry import RolloutEntry
from weightsync.publisher.rollout_calls import RolloutCalls
from weightsync.publisher.straggler import gather
from weightsync.publisher.stream_phase import StreamPhase
from weightsync.v1 import bus_pb2, rollout_pb2, trainer_pb2

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
        self._pool = fleet.pool  # long-lived: no threads started per sync
        #: delta or full per target (weightsync/publisher/delta_sync.py)
        self.delta = fleet.delta.begin(manifest, session.name)
        #: targets already sent AbortSync (to learn why their stream broke)
        self.aborted: set[str] = set()
        #: rollout_id -> seconds it was silent when dropped from this attempt (its call still runs)
        self.dropped: dict[str, float] = {}
        self.streamer = StreamPhase(self)

    @property
    def route(self):
        """The path this attempt's stream took (weightsync/publisher/route.py)."""
        return self.streamer.route

    @property
    def senders(self):
        """What each sending rank did in the stream (one entry for the single sender)."""
        return self.streamer.senders

    def run(self) -> tuple[dict[str, trainer_pb2.RolloutSyncResult], list[RolloutEntry]]:
        """The results and the targets of a retry ([] for none)."""
        try:
            with self.phases("prepare"):
                # The actor's own storage needs no export: its checksums start on the GPU while the
                # rollouts answer PrepareSync, and the stream reads them when it needs them.
                self.prepare(meanwhile=self.streamer.start_in_place)
            # a group built in this sync: its stream includes the build (nccl; not a measure of the link)
            fresh = not self.session.reused
            with self.phases("stream"):
                checksums = self.stream()
            self.delta.streamed(self.streamer.bus_bytes, self.streamer.send_seconds, fresh, self.streamer.link_rate)
            with self.phases("commit"):
                self.commit(checksums)
                self.abort_failed()
        finally:
            self.streamer.close()
        return self.results, self.retry

    def stream(self) -> list[int]:
        """Every bucket to every prepared target; returns the bucket checksums ([] if nothing was streamed)."""
        return self.streamer.run()

    def left(self) -> float:
        return max(0.001, self.deadline - time.monotonic())

    def fail(self, rid: str, reason: str, err: str) -> None:
        self.rollouts.fail(self.results[rid], self.by_id[rid], reason, err)

    def gone(self, rid: str) -> bool:
        """A call to it would only wait: it went silent in this sync (dropped here, or its link gave up)."""
        return rid in self.dropped or self.rollouts.gone(self.by_id[rid])

    def linked(self, rid: str) -> bool:
        return self.rollouts.link_of(self.by_id[rid]) is not None

    def _drop_silent(self, rids: dict[str, float], phase: str, answered: int, answered_s: float) -> None:
        """Fail the targets that stayed silent while `answered` others answered `phase` in `answered_s`."""
        for rid, silent_s in rids.items():
            self.dropped[rid] = silent_s
            e = self.by_id[rid]
            e.reachable = False
            if phase == "prepare":
                fate = f"dropped from this sync; it stays at version {e.version} (stale) until a later sync"
            else:
                fate = (
                    f"commit unconfirmed: it commits version {self.manifest.version} whole if it resumes "
                    "before its prepare times out, else it keeps its version; either way a later sync catches it up"
                )
            self.fail(
                rid,
                "silent",
                f"{phase}: UNAVAILABLE: the rollout went silent (no answer nor acknowledgement for {silent_s:.2f}s "
                f"while {answered} other(s) answered in {answered_s:.2f}s): {fate}",
            )

    # ---- prepare ----------------------------------------------------------------------------
    def prepare(self, meanwhile: Callable[[], None] | None = None) -> None:
        """PrepareSync on every target; keeps those that prepared and whose answer the session accepts.

        `meanwhile` runs once the requests are out, before their answers are read: the trainer's
        own work for the sync overlaps the rollouts'."""
        answers = self._prepare_calls(meanwhile)
        for e in self.targets:
            if e.rollout_id in self.dropped:
                continue
            resp, err = answers[e.rollout_id]
            err = err or self.session.accept(e, resp)
            if err and self.session.sender_gpu_clash:
                r = self.results[e.rollout_id]  # retried through the funnel: not a failure of this rollout
                r.ok, r.error = False, f"prepare: {err}"
            elif err:
                self.fail(e.rollout_id, "prepare_failed", f"prepare: {err}")
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
        compact = compact_proto(self.manifest) if digest else None
        full: dict[bool, bus_pb2.Manifest] = {}  # runs? -> the full manifest in that form
        out: dict[str, tuple[rollout_pb2.PrepareSyncResponse | None, str]] = {}
        pending = list(self.targets)
        while pending:
            calls = []
            for e in pending:
                send_full = compact is None or not cache.holds(e, digest)
                # a rollout that reads run entries gets a MoE layer's experts as one entry (weightsync.bus.runs)
                runs = e.manifest_runs
                if send_full and runs not in full:
                    full[runs] = cache.full_proto(self.manifest, runs=runs)
                req = rollout_pb2.PrepareSyncRequest(
                    manifest=full[runs] if send_full else compact,
                    timeout_seconds=self.left(),
                    transport=self.session.spec_for(e),
                    trainer_id=self.fleet.trainer_id,
                    allow_rollback=self.allow_rollback,
                    delta_base=self.delta.offer,
                    traceparent=tracing.traceparent(),
                )
                calls.append((e, send_full, req))
            pending = []
            answers = self._prepare_answers([(e, req) for e, _, req in calls], meanwhile)
            meanwhile = None
            for e, sent_full, _ in calls:
                if e.rollout_id not in answers:  # dropped: silent
                    cache.forget(e)
                    continue
                resp, err = answers[e.rollout_id]
                if not err:
                    e.manifest_runs = resp.manifest_runs  # a restarted rollout may be another build
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

    def _prepare_answers(self, calls: list[tuple[RolloutEntry, rollout_pb2.PrepareSyncRequest]], meanwhile) -> dict:
        """rollout_id -> (answer, error) of each PrepareSync in `calls`, `meanwhile` run once they are out.

        One target on its sync link (a colocated CUDA IPC sync, most often): the request is sent on this
        thread, `meanwhile` runs, then the answer is read here, waiting already in the socket when the
        rollout was quicker. No pool thread takes the call and none hands its answer back (three thread
        wake-ups on the path of every sync: the pool's, the caller's once the call started, the caller's on
        the answer), and the trainer's own work no longer fights the call's thread for the GIL. There is no
        other target to compare its silence with (`gather` would wait for it too), and its link still gives
        up on it after liveness_timeout_s without a beat."""
        if meanwhile is not None and len(calls) == 1 and self.rollouts.link_of(calls[0][0]) is not None:
            e, req = calls[0]
            finish = self.rollouts.send(e, "PrepareSync", req, timeout=self._prepare_timeout(req))
            if finish is not None:
                try:
                    meanwhile()
                finally:  # the answer is read even when the trainer's work failed: the link is free again
                    answer = finish()
                return {e.rollout_id: answer}
        return self._gather(
            "prepare",
            {e.rollout_id: self._prepare_call(e, req) for e, req in calls},
            meanwhile,
            on_late=self._late_prepare,
        )

    def _prepare_call(self, e: RolloutEntry, req: rollout_pb2.PrepareSyncRequest) -> Callable:
        """The PrepareSync call to `e`, bounded by `_prepare_timeout`."""
        timeout = self._prepare_timeout(req)
        if timeout is None:
            return functools.partial(self.rollouts.call, e, "PrepareSync", req)
        return functools.partial(self.rollouts.call, e, "PrepareSync", req, timeout=timeout)

    def _prepare_timeout(self, req: rollout_pb2.PrepareSyncRequest) -> float | None:
        """rpc_timeout_s (None), except for a prepare that pauses generation before it answers (CUDA IPC
        trainer_writes: the rollout waits for its running requests to finish, as an in-place sync's first
        bucket does). That wait belongs to the sync, so the call is bounded by what is left of the sync's
        deadline, as the rollout bounds the pause itself (timeout_seconds); a rollout that hangs still fails
        it within liveness_timeout_s on its sync link (no beat), and over gRPC by the deadline."""
        t = req.transport
        if t.WhichOneof("kind") == "ipc" and t.ipc.trainer_writes:
            return self.left()
        return None

    def _late_prepare(self, rid: str, answer) -> None:
        """A dropped rollout answered after all (it resumed): what it prepared must never commit."""
        resp, err = answer
        if resp is None or err or resp.manifest_needed:
            return  # nothing prepared
        log.warning(
            "sync %s: %s answered PrepareSync after it was dropped as silent; aborting what it prepared "
            "(a later sync catches it up)",
            self.manifest.sync_id,
            rid,
        )
        _, err = self.rollouts.call(self.by_id[rid], "AbortSync", self.abort_request())
        if err:  # its own timer aborts it (timeout_seconds), and any newer prepare supersedes it
            log.warning("sync %s: AbortSync to %s after its late prepare failed: %s", self.manifest.sync_id, rid, err)

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
                self.fail(rid, "transport", msg)
        self.prepared.clear()

    # ---- commit / abort ---------------------------------------------------------------------
    def commit_request(self, checksums: list[int]) -> rollout_pb2.CommitSyncRequest:
        req = rollout_pb2.CommitSyncRequest(
            sync_id=self.manifest.sync_id,
            version=self.manifest.version,
            trainer_id=self.fleet.trainer_id,
            traceparent=tracing.traceparent(),
        )
        for i, c in enumerate(checksums):
            req.checksums.add(index=i, checksum=c)
        return req

    def commit(self, checksums: list[int]) -> None:
        """CommitSync on every target still in the sync; a target sent its commit as the last bucket
        went out (weightsync.publisher.early_commit) has its answer read here."""
        req = self.commit_request(checksums)
        answers = self._gather(
            "commit",
            {rid: functools.partial(self._commit_one, rid, req) for rid in self.prepared},
            on_late=self._late_commit,
        )
        for rid, (resp, err) in answers.items():
            e, r = self.by_id[rid], self.results[rid]
            if err:
                if err.startswith("DATA_LOSS"):  # the rollout's checksums found corruption (at commit on a GPU)
                    self.fail(rid, "data_loss", f"{err} (reported at commit)")
                else:
                    self.fail(rid, "commit_failed", f"commit: {err}")
                if rid not in self.delta.accepted:
                    self.delta.commit_failed()  # a dense bucket refused: the trainer's base is suspect
            else:
                r.ok, r.version = True, resp.version
                r.bytes_per_rank[:] = resp.bytes_per_rank
                e.version, e.state, e.reachable, e.last_error = resp.version, rollout_pb2.SERVING, True, ""
                e.origin = self.fleet.origin

    def _commit_one(self, rid: str, req: rollout_pb2.CommitSyncRequest):
        if self.streamer.early.sent(rid):
            return self.streamer.early.answer(rid)
        if rid in self.streamer.on_stream:
            return self.streamer.commit_channel.commit(rid, req, timeout=self.rollouts.rpc_timeout)
        return self.rollouts.call(self.by_id[rid], "CommitSync", req)

    def _late_commit(self, rid: str, answer) -> None:
        """A rollout dropped at commit answered after all: its commit is whole either way (atomic)."""
        resp, err = answer
        if resp is not None and not err:
            e = self.by_id[rid]
            e.version, e.origin, e.reachable = resp.version, self.fleet.origin, True
        log.warning(
            "sync %s: %s answered CommitSync after it was dropped as silent: %s",
            self.manifest.sync_id,
            rid,
            f"committed version {resp.version}" if resp is not None and not err else err,
        )

    def _gather(self, phase: str, calls: dict, meanwhile=None, on_late=None) -> dict:
        """rollout_id -> (answer, error) of every call of `phase` that was answered; the targets that
        stayed silent while the others answered are failed and dropped (weightsync.publisher.straggler)."""
        got = gather(
            self._pool,
            calls,
            lambda rid, since: self.rollouts.heard_since(self.by_id[rid], since),
            self.deadline,
            meanwhile=meanwhile,
            on_late=on_late,
        )
        if got.dropped:
            self._drop_silent(got.dropped, phase, len(got.answers), got.seconds)
        return got.answers

    def abort_failed(self) -> None:
        """AbortSync on every target that did not commit, so none is left holding a prepared sync.

        Not on one that went silent: the call would wait for it, holding this Sync; its own timer
        (timeout_seconds) aborts what it prepared, and the catch-up sync supersedes it."""
        req = self.abort_request()
        failed = [
            self.by_id[r.rollout_id]
            for r in self.results.values()
            if not r.ok and r.rollout_id not in self.aborted and not self.gone(r.rollout_id)
        ]
        self.on_each(lambda e: self.rollouts.call(e, "AbortSync", req), failed)

    def abort_request(self) -> rollout_pb2.AbortSyncRequest:
        return rollout_pb2.AbortSyncRequest(
            sync_id=self.manifest.sync_id, reason="trainer aborted the sync", trainer_id=self.fleet.trainer_id
        )

    def on_each(self, fn: Callable, items: list) -> list:
        """[fn(x) for x in items], all at once: the first on this thread, the others on the RPC
        pool's (a sync to one rollout hands nothing to another thread and back)."""
        futs = [self._pool.submit(fn, x) for x in items[1:]]
        try:
            first = [fn(items[0])] if items else []
        except BaseException:  # the calls already out end before the failure is raised
            futures.wait(futs, timeout=self.left())
            raise
        return first + [f.result() for f in futs]
