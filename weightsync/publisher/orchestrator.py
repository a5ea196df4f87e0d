"""Sync orchestration on the trainer: prepare every target → stream buckets → commit, or abort.

With tcp and ipc, targets succeed or fail individually: a rollout that rejects the manifest,
drops off the bus or fails its commit is aborted and reported, and the others still commit.
With nccl a failure to join or during the stream is group-wide (a collective needs every rank):
every target of that sync is aborted. A rollout that fails the prepare (unreachable, no GPU, a
GPU already in the group) is left out instead, and the others are synced in a group without it
(a retry within the same Sync call). Every rollout ends on a complete version: the new one if
it committed, otherwise the one it served before (or STALE, refusing generation, in inplace
mode — see rollout_svc.sync.transaction). Each transport's sender lives in weightsync/bus/{tcp,nccl,ipc}/sender.py.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from weightsync.bus.copy.checksum import ALGO
from weightsync.bus.layout import ManifestCache
from weightsync.bus.transports import TRANSPORTS, TrainerSide, choices, multi_sender_names
from weightsync.obs import tracing
from weightsync.obs.metrics import SyncMetrics
from weightsync.obs.sync_profile import SyncProfile
from weightsync.publisher.attempt import SyncAttempt
from weightsync.publisher.delta_sync import DeltaBase
from weightsync.publisher.export_format import PLAIN, export_format
from weightsync.publisher.phases import PhaseClock
from weightsync.publisher.registry import RolloutEntry, RolloutRegistry
from weightsync.publisher.rollout_calls import RolloutCalls
from weightsync.sync_options import DEFAULTS, SyncOptions
from weightsync.v1 import rollout_pb2, trainer_pb2

log = logging.getLogger(__name__)


class SyncInProgress(RuntimeError):
    pass


class SyncOrchestrator:
    def __init__(
        self,
        actor,
        actor_lock: threading.Lock,
        registry: RolloutRegistry,
        metrics: SyncMetrics,
        *,
        token: str,
        options: SyncOptions = DEFAULTS,
        trainer_id: str = "",
        origin: str = "",
    ):
        """`options`: how it syncs (weightsync/sync_options.py); `origin`: this trainer run's identity
        (Manifest.origin; default a new one)."""
        self.actor = actor
        self.actor_lock = actor_lock
        self.registry = registry
        self.metrics = metrics
        self.token = token
        self.options = options
        self.bucket_bytes = options.bucket_bytes
        self.default_transport = options.transport
        self.sync_timeout = options.sync_timeout_s
        self.rpc_timeout = options.rpc_timeout_s
        self.origin = origin or uuid.uuid4().hex[:16]
        self.trainer_id = trainer_id
        self.device = torch.device(options.device)
        self.export_format = export_format(options.export_dtype) if options.export_dtype else PLAIN
        #: the last committed export, kept for delta syncs (weightsync/publisher/delta_sync.py)
        self.delta = DeltaBase(options.sync_encoding, options.delta_base_bytes, self.origin, options.delta_link_gbps)
        #: the syncs' host time by function (debug.profile_syncs; off unless set)
        self.profile = SyncProfile()
        metrics.nccl_link_rate.set_function(lambda: self.delta.link_rate or 0.0)
        self.senders = options.senders
        #: how this trainer reaches a rollout during a sync (sync link or gRPC), and records a failed one
        self.rollouts = RolloutCalls(token, options.rpc_timeout_s, metrics, options.sync_link)
        self.rollouts.liveness_timeout = options.liveness_timeout_s
        side = TrainerSide(
            token,
            self.device,
            call=self.rollouts.call,
            open_stream=self.rollouts.open_stream,
            options={
                "nccl": {"init_timeout": options.nccl_init_timeout_s, "on_build": metrics.nccl_group_builds.inc},
                "ipc": {"direction": options.ipc_direction},
            },
        )
        #: transport name -> its trainer end (weightsync.bus.transports), kept for the trainer's lifetime
        self.transports = {t.name: t.trainer_end_class().for_trainer(side) for t in TRANSPORTS.values()}
        self.last_report = trainer_pb2.SyncReport()
        #: the version this trainer's latest sync committed to at least one rollout (None before any):
        #: the fleet's version, which a registering rollout is caught up to when it lacks it
        self.fleet_version: int | None = None
        self.in_progress = False
        #: the running sync's clock and what is known of it (GetSyncProgress); None between syncs
        self._live: tuple[PhaseClock, trainer_pb2.SyncProgress] | None = None
        # Kept across syncs: the planned layout (re-planned only when the export metadata changes,
        # sent in full once per rollout) and the RPC threads that reach every target at once.
        self.manifests = ManifestCache()
        # sync ids: this trainer's random prefix and a count (a uuid4 per sync read the OS's entropy:
        # 0.14 ms of every sync on a loaded sandboxed host, bench/control_plane.py)
        self._sync_ids, self._sync_count = uuid.uuid4().hex[:8], itertools.count(1)
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="sync-rpc")
        self._warned_funnel = False
        #: (rollout id, address) of rollouts found on the GPU of a sending rank other than 0: syncs to
        #: them over a transport that takes one rank per GPU (NCCL) funnel. Keyed by address too, so
        #: a rollout rescheduled elsewhere (a new pod, a new address) is given multi-sender streaming again.
        self._gpu_clash: set[tuple[str, str]] = set()

    def sync(
        self,
        targets: list[RolloutEntry],
        transport: str = "",
        timeout: float = 0.0,
        wait_s: float = 0.0,
        allow_rollback: bool = False,
        only_behind: bool = False,
        senders: str = "",
        ipc_direction: str = "",
    ) -> trainer_pb2.SyncReport | None:
        """Sync `targets`; with `only_behind` (a catch-up), first drop those that need none
        (`needs_catch_up`, asked afresh once no other sync runs) and return None when none is left —
        a catch-up queued while another sync ran is often made moot by it. `ipc_direction`: this sync's, over
        transport ipc ("" = the trainer's ipc_direction)."""
        transport = transport or self.default_transport
        if ipc_direction:
            from weightsync.bus.ipc.trainer_writes import DIRECTIONS

            if ipc_direction not in DIRECTIONS:
                raise ValueError(f"ipc_direction={ipc_direction!r} must be {', '.join(DIRECTIONS)} (or empty)")
            if transport != "ipc":
                raise ValueError(
                    f"ipc_direction={ipc_direction} applies to transport ipc; this sync runs over {transport}"
                )
        if senders == "all" and transport in TRANSPORTS and not TRANSPORTS[transport].multi_sender:
            multi = choices(multi_sender_names())
            raise ValueError(
                f"senders=all streams over {multi}; transport={transport} carries the buckets of global "
                f"rank 0 alone: ask for senders=rank0 (or leave it empty), or transport {multi}"
            )
        senders = senders or self.senders
        if senders not in ("all", "rank0"):
            raise ValueError(f"senders={senders!r} must be all or rank0")
        timeout = timeout or self.sync_timeout
        if transport not in self.transports:
            raise ValueError(f"transport={transport!r} must be one of {sorted(self.transports)}")
        self.delta.check(transport)
        if not self.actor_lock.acquire(timeout=wait_s):
            raise SyncInProgress("another sync or weight load is running; retry when it finishes")
        try:
            if only_behind:
                for e in targets:
                    self.registry.poll(e)
                targets = [e for e in targets if self.needs_catch_up(e)]
                if not targets:
                    return None
            self.in_progress = True
            self.metrics.in_progress.set(1)
            if allow_rollback:
                self.metrics.rollbacks.inc()
                log.warning(
                    "ROLLBACK requested: sync of version %d to %s may take rollouts back to a lower version",
                    self.actor.version,
                    [e.rollout_id for e in targets] or "every rollout",
                )
            with self.profile.watching(), tracing.sync_span(transport) as trace:
                report = self._sync_locked(targets, transport, timeout, senders, allow_rollback, ipc_direction)
                trace.finish(report)
            self.profile.flush()
            return report
        finally:
            self.in_progress = False
            self._live = None
            self.metrics.in_progress.set(0)
            self.actor_lock.release()

    def progress(self) -> trainer_pb2.SyncProgress:
        """Where the running sync stands (phase, bytes), asking no rollout: cheap enough to poll."""
        live = self._live
        if live is None:
            return trainer_pb2.SyncProgress()
        phases, known = live
        out = trainer_pb2.SyncProgress()
        out.CopyFrom(known)
        out.in_progress, out.phase, out.bytes_sent = True, phases.current, phases.bytes_sent
        out.seconds = time.monotonic() - phases.started
        return out

    def _sync_locked(
        self,
        targets: list[RolloutEntry],
        transport: str,
        timeout: float,
        senders: str = "all",
        allow_rollback: bool = False,
        ipc_direction: str = "",
    ) -> trainer_pb2.SyncReport:
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        phases = PhaseClock()
        self._live = (phases, trainer_pb2.SyncProgress(transport=transport, num_rollouts=len(targets)))
        by_id = {e.rollout_id: e for e in targets}
        results: dict[str, trainer_pb2.RolloutSyncResult] = {}
        if (
            TRANSPORTS[transport].one_rank_per_gpu
            and senders == "all"
            and any((e.rollout_id, e.address) in self._gpu_clash for e in targets)
        ):
            senders = "rank0"  # learned at an earlier prepare: a target sits on a sending rank's GPU
        for attempt in (1, 2, 3):
            with phases("plan"):
                session, manifest = self._plan(targets, transport, senders, ipc_direction)
            tracing.planned(manifest.sync_id, manifest.version, manifest.total_bytes)
            report = trainer_pb2.SyncReport(
                sync_id=manifest.sync_id,
                version=manifest.version,
                transport=transport,
                bytes=manifest.total_bytes,
                num_buckets=len(manifest.buckets),
                num_tensors=manifest.num_tensors,
            )
            if not targets:
                report.ok = False
                log.warning("sync %s: no rollout registered", manifest.sync_id)
                self.last_report = report
                return report
            # DEBUG: it is written inside the sync's time; the summary after the commit says it at INFO
            log.debug(
                "sync %s: version %d to %d rollout(s), %d tensors in %d buckets (%.1f MB) over %s%s",
                manifest.sync_id,
                manifest.version,
                len(targets),
                manifest.num_tensors,
                len(manifest.buckets),
                manifest.total_bytes / 1e6,
                transport,
                " (cached group)" if session.reused else "",
            )
            phases.progress(bytes_sent=0)  # a retry streams from the start
            self._live = (
                phases,
                trainer_pb2.SyncProgress(
                    sync_id=manifest.sync_id,
                    version=manifest.version,
                    bytes=manifest.total_bytes,
                    num_rollouts=len(targets),
                    transport=transport,
                ),
            )
            one = SyncAttempt(
                self, session, manifest, targets, deadline, phases, tensors=self._export, allow_rollback=allow_rollback
            )
            attempt_results, retry = one.run()
            report.route = str(one.route or "")
            results.update(attempt_results)  # a retried rollout's result replaces its earlier one
            if not retry or attempt == 3:
                break
            if one.funnel_retry:
                log.warning(
                    "sync %s: %s; NCCL takes one rank per GPU, so syncs to it stream from global rank 0 "
                    "(senders=rank0)",
                    manifest.sync_id,
                    one.funnel_retry,
                )
                senders = "rank0"
                self._gpu_clash |= {(rid, by_id[rid].address) for rid in session.clashing}
            self._log_retry(manifest.sync_id, targets, retry)
            targets = retry
        self._report(report, results, by_id, manifest, phases, time.perf_counter() - t0)
        self._report_senders(report, one.senders)
        self.last_report = report
        if any(r.ok for r in report.rollouts):
            self.fleet_version = report.version
        return report

    def _export(self):
        """The stream `_plan`'s manifest describes: the actor's tensors in the export format."""
        return self.export_format.tensors(self.actor.export_tensors())

    def _plan(self, targets: list[RolloutEntry], transport: str, senders: str = "all", ipc_direction: str = ""):
        """(the transport's session for this sync or None without targets, the manifest of the actor's weights)."""
        version = self.actor.version
        sync_id = f"v{version}-{self._sync_ids}{next(self._sync_count):04x}"
        # raises ValueError (→ INVALID_ARGUMENT) when this trainer cannot use the transport at all
        extra = {"direction": ipc_direction} if ipc_direction else {}
        session = self.transports[transport].begin(targets, sync_id, self.bucket_bytes, **extra) if targets else None
        plain = self.actor.export_metas()
        manifest = self.manifests.manifest(
            self.export_format.metas(plain),
            version=version,
            sync_id=sync_id,
            bucket_bytes=self.bucket_bytes,
            model_family=self.actor.family,
            checksum_algo=ALGO,
            origin=self.origin,
            quantization=self.export_format.quantization,
            owners=self._owners(transport, senders, plain),
        )
        if session is not None:
            session.use_manifest(manifest)
        if session is not None and manifest.quantization is not None:
            # ipc trainer_writes of block FP8 into an engine that dequantizes (the bus imports no format)
            from weightsync.formats.fp8.trainer_writes import Fp8Writes

            session.use_quantized_writes(Fp8Writes())
        if session is not None and len(manifest.senders) > 1:
            session.use_senders(manifest.senders, self.actor.rank_gpus)  # nccl: a group per rank
        return session, manifest

    def _owners(self, transport: str, senders: str, plain=None) -> list[int] | None:
        """Each tensor's sender rank when every owner streams its own (senders=all over tcp or nccl),
        else None: the funnel through rank 0."""
        owners = self.actor.export_owners() if senders == "all" else None
        if owners is None:
            return None
        # a quantized format gives each weight's scale the weight's owner (each rank quantizes its own)
        plain = self.actor.export_metas() if plain is None else plain  # the actor's metas, unformatted
        owners = self.export_format.owners(plain, owners)
        if not TRANSPORTS[transport].multi_sender and len(set(owners)) > 1:
            if not self._warned_funnel:
                log.warning(
                    "transport=%s streams from global rank 0 only: every tensor is sent there first "
                    "(multi-sender streaming is built for %s; docs/architecture.md)",
                    transport,
                    " and ".join(multi_sender_names()),
                )
                self._warned_funnel = True
            return None
        return owners

    def _report_senders(self, report: trainer_pb2.SyncReport, senders) -> None:
        """The per-sender split of the stream, in the report and the metrics."""
        m = self.metrics
        for s in senders:
            report.senders.add(
                rank=s.rank,
                bytes=s.bytes,
                num_buckets=s.buckets,
                seconds=s.seconds,
                error=s.error,
                forwarded_bytes=s.forwarded_bytes,
                peak_buffer_bytes=s.peak_buffer_bytes,
                flat_buckets=s.flat_buckets,
            )
            tracing.sender_groups(s.rank, s.groups)
            rank = str(s.rank)
            m.sender_bytes.labels(m.role, rank).inc(s.bytes)
            m.sender_seconds.labels(m.role, rank).observe(s.seconds)
            m.forwarded_bytes.labels(m.role, rank).inc(s.forwarded_bytes)
            m.sender_buffer_bytes.labels(m.role, rank).set(s.peak_buffer_bytes)
        if len(senders) > 1:
            log.info(
                "sync %s: per sender %s",
                report.sync_id,
                ", ".join(f"rank {s.rank} {s.bytes / 1e6:.1f} MB in {s.seconds:.3f}s" for s in senders),
            )

    @staticmethod
    def _log_retry(sync_id: str, targets: list[RolloutEntry], retry: list[RolloutEntry]) -> None:
        if len(retry) == len(targets):
            log.warning(
                "sync %s: a member lacked the cached NCCL group (restarted?); retrying with a new group", sync_id
            )
        else:
            left_out = sorted({e.rollout_id for e in targets} - {e.rollout_id for e in retry})
            log.warning(
                "sync %s: %s could not take part; retrying with the %d rollout(s) that prepared",
                sync_id,
                ", ".join(left_out),
                len(retry),
            )

    def _report(
        self,
        report: trainer_pb2.SyncReport,
        results: dict[str, trainer_pb2.RolloutSyncResult],
        by_id: dict[str, RolloutEntry],
        manifest,
        phases: PhaseClock,
        elapsed: float,
    ) -> None:
        """Fill the report of the sync and record its metrics."""
        for r in results.values():
            r.seconds = elapsed
            by_id[r.rollout_id].last_sync_seconds = elapsed
        report.rollouts.extend(results.values())
        report.ok = all(r.ok for r in results.values())
        report.seconds = elapsed
        m, route = self.metrics, report.route
        for name, seconds in phases.seconds.items():
            report.phase_seconds[name] = seconds
            m.sync_phase.labels(m.role, name, route).observe(seconds)
        report.gbps = manifest.total_bytes / elapsed / 1e9 if elapsed > 0 else 0.0
        report.wire_bytes = sum(r.wire_bytes for r in results.values())
        for r in results.values():
            if r.encoding:
                self.metrics.sync_wire_bytes.labels(self.metrics.role, r.encoding).inc(r.wire_bytes)
        committed = sum(r.ok for r in results.values())
        m.sync_duration.labels(m.role, route).observe(elapsed)
        self.metrics.sync_bytes.inc(manifest.total_bytes * committed)
        self.metrics.outcome("ok" if report.ok else ("partial" if committed else "failed"))
        log.info(
            "sync %s: version %d, %d tensors in %d buckets (%.1f MB): %d/%d committed in %.3fs over route %s "
            "(%.2f GB/s per receiver; %s); %.1f kB on the bus, %d as deltas",
            report.sync_id,
            report.version,
            report.num_tensors,
            report.num_buckets,
            manifest.total_bytes / 1e6,
            committed,
            len(results),
            elapsed,
            route,
            report.gbps,
            phases,
            report.wire_bytes / 1e3,
            sum(r.encoding == "delta" for r in results.values()),
        )

    def is_current(self, entry: RolloutEntry) -> bool:
        return entry.origin == self.origin and entry.version == self.actor.version

    def needs_catch_up(self, entry: RolloutEntry) -> bool:
        """Whether a registering rollout missed what the fleet has. One that is on the version this
        trainer last committed, and behind only because the trainer loaded or trained a newer one
        since, is not: the fleet's next sync takes it. A catch-up of its own between a weight update
        and that sync would stream the same version twice and hold the sync lock the caller's sync
        then finds taken. Before any commit, anything but the trainer's version is behind; a STALE
        rollout (a failed in-place apply) is always caught up: it refuses generation until then.

        Except one whose GPU memory is released (colocated RL, ReleaseMemory): a train step owns that GPU
        now or is about to, and a catch-up (it would take the sync lock between the release and the
        step) would map the rollout's weights and KV cache back under the trainer. The driver's sync after
        the step targets every rollout, behind or not, and maps the memory back itself."""
        if self.is_current(entry) or entry.memory_released:
            return False
        if entry.state == rollout_pb2.STALE:
            return True
        return not (entry.origin == self.origin and entry.version == self.fleet_version)
