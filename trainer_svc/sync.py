"""Sync orchestration on the trainer: prepare every target → stream buckets → commit, or abort.

With tcp and ipc, targets succeed or fail individually: a rollout that rejects the manifest,
drops off the bus or fails its commit is aborted and reported, and the others still commit.
With nccl a failure to join or during the stream is group-wide (a collective needs every rank):
every target of that sync is aborted. A rollout that fails the prepare (unreachable, no GPU, a
GPU already in the group) is left out instead, and the others are synced in a group without it
(a retry within the same Sync call). Every rollout ends on a complete version: the new one if
it committed, otherwise the one it served before (or STALE, refusing generation, in inplace
mode — see rollout_svc.transaction). Each transport's sender lives in weightsync/bus/{tcp,nccl,ipc}/sender.py.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from trainer_svc.registry import RolloutEntry, RolloutRegistry
from weightsync.bus.checksum import ALGO
from weightsync.bus.ipc.sender import IpcSender
from weightsync.bus.nccl.sender import NcclSender
from weightsync.bus.pipeline import stream_buckets
from weightsync.bus.plan import make_manifest, manifest_to_proto
from weightsync.bus.tcp.sender import TcpSender
from weightsync.control.client import describe_rpc_error
from weightsync.obs.metrics import SyncMetrics
from weightsync.v1 import rollout_pb2, trainer_pb2

log = logging.getLogger(__name__)


class SyncInProgress(RuntimeError):
    pass


class SyncOrchestrator:
    def __init__(self, actor, actor_lock: threading.Lock, registry: RolloutRegistry, metrics: SyncMetrics, *,
                 token: str, bucket_bytes: int, default_transport: str, sync_timeout: float, rpc_timeout: float,
                 origin: str, device: torch.device | str = "cpu", nccl_bus=None, nccl_init_timeout: float = 120.0,
                 on_nccl_group_build=None):
        self.actor = actor
        self.actor_lock = actor_lock
        self.registry = registry
        self.metrics = metrics
        self.token = token
        self.bucket_bytes = bucket_bytes
        self.default_transport = default_transport
        self.sync_timeout = sync_timeout
        self.rpc_timeout = rpc_timeout
        self.origin = origin
        self.device = torch.device(device)
        self.transports = {"tcp": TcpSender(token),
                           "nccl": NcclSender(self.device, nccl_bus, nccl_init_timeout, on_nccl_group_build,
                                            call=self._call),
                           "ipc": IpcSender(self.device, self._call)}
        self.last_report = trainer_pb2.SyncReport()
        self.in_progress = False

    def sync(self, targets: list[RolloutEntry], transport: str = "", timeout: float = 0.0,
             wait_s: float = 0.0) -> trainer_pb2.SyncReport:
        transport = transport or self.default_transport
        timeout = timeout or self.sync_timeout
        if transport not in self.transports:
            raise ValueError(f"transport={transport!r} must be one of {sorted(self.transports)}")
        if not self.actor_lock.acquire(timeout=wait_s):
            raise SyncInProgress("another sync or weight load is running; retry when it finishes")
        try:
            self.in_progress = True
            self.metrics.in_progress.set(1)
            return self._sync_locked(targets, transport, timeout)
        finally:
            self.in_progress = False
            self.metrics.in_progress.set(0)
            self.actor_lock.release()

    def _sync_locked(self, targets: list[RolloutEntry], transport: str, timeout: float) -> trainer_pb2.SyncReport:
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        version = self.actor.version
        phases = PhaseClock()
        by_id = {e.rollout_id: e for e in targets}
        final: dict[str, trainer_pb2.RolloutSyncResult] = {}
        for attempt in (1, 2, 3):
            sync_id = f"v{version}-{uuid.uuid4().hex[:12]}"
            with phases("plan"):
                # raises ValueError (→ INVALID_ARGUMENT) when this trainer cannot use the transport at all
                session = self.transports[transport].begin(targets, sync_id, self.bucket_bytes) if targets else None
                manifest = make_manifest(self.actor.export_metas(), version=version, sync_id=sync_id,
                                         bucket_bytes=self.bucket_bytes, model_family=self.actor.family,
                                         checksum_algo=ALGO, origin=self.origin)
            report = trainer_pb2.SyncReport(sync_id=sync_id, version=version, transport=transport,
                                            bytes=manifest.total_bytes, num_buckets=len(manifest.buckets),
                                            num_tensors=manifest.num_tensors)
            if not targets:
                report.ok = False
                log.warning("sync %s: no rollout registered", sync_id)
                self.last_report = report
                return report
            log.info("sync %s: version %d to %d rollout(s), %d tensors in %d buckets (%.1f MB) over %s%s", sync_id,
                     version, len(targets), manifest.num_tensors, len(manifest.buckets), manifest.total_bytes / 1e6,
                     transport, " (cached group)" if session.reused else "")
            results, retry = self._attempt(session, manifest, targets, deadline, phases)
            final.update(results)  # a retried rollout's result replaces its earlier one
            if not retry or attempt == 3:
                break
            if len(retry) == len(targets):
                log.warning("sync %s: a member lacked the cached NCCL group (restarted?); retrying with a new group",
                            sync_id)
            else:
                left_out = sorted({e.rollout_id for e in targets} - {e.rollout_id for e in retry})
                log.warning("sync %s: %s could not take part; retrying with the %d rollout(s) that prepared",
                            sync_id, ", ".join(left_out), len(retry))
            targets = retry
        results = final
        elapsed = time.perf_counter() - t0
        for r in results.values():
            r.seconds = elapsed
            by_id[r.rollout_id].last_sync_seconds = elapsed
        report.rollouts.extend(results.values())
        report.ok = all(r.ok for r in results.values())
        report.seconds = elapsed
        for name, seconds in phases.seconds.items():
            report.phase_seconds[name] = seconds
            self.metrics.sync_phase.labels(self.metrics.role, name).observe(seconds)
        report.gbps = manifest.total_bytes / elapsed / 1e9 if elapsed > 0 else 0.0
        committed = sum(r.ok for r in results.values())
        self.metrics.sync_duration.observe(elapsed)
        self.metrics.sync_bytes.inc(manifest.total_bytes * committed)
        self.metrics.outcome("ok" if report.ok else ("partial" if committed else "failed"))
        log.info("sync %s: %d/%d committed in %.3fs (%.2f GB/s per receiver; %s)", report.sync_id, committed,
                 len(results), elapsed, report.gbps, phases)
        self.last_report = report
        return report

    def _attempt(self, session, manifest, targets: list[RolloutEntry], deadline: float,
                 phases: PhaseClock) -> tuple[dict[str, trainer_pb2.RolloutSyncResult], list[RolloutEntry]]:
        """One prepare → stream → commit | abort pass.

        Returns the results and the targets of a retry ([] for none): a group-wide transport
        retries when the prepare failed on some member — with every member and a new group when
        the cached group was refused (a restarted member), else with the members that prepared.
        """
        sync_id, version = manifest.sync_id, manifest.version
        results = {e.rollout_id: trainer_pb2.RolloutSyncResult(rollout_id=e.rollout_id) for e in targets}
        by_id = {e.rollout_id: e for e in targets}
        left = lambda: max(0.001, deadline - time.monotonic())  # noqa: E731
        pool = ThreadPoolExecutor(max_workers=max(1, len(targets)), thread_name_prefix="sync-rpc")
        retry: list[RolloutEntry] = []
        try:
            prepared: dict[str, rollout_pb2.PrepareSyncResponse] = {}
            calls = []
            t_prepare = time.perf_counter()
            manifest_pb = manifest_to_proto(manifest)  # once: it is the same for every target
            for e in targets:
                req = rollout_pb2.PrepareSyncRequest(manifest=manifest_pb, timeout_seconds=left(),
                                                     transport=session.spec_for(e))
                calls.append((e, pool.submit(self._call, e, "PrepareSync", req)))
            for e, fut in calls:
                resp, err = fut.result()
                err = err or session.accept(e, resp)
                if err:
                    self._fail(results[e.rollout_id], e, "prepare_failed", f"prepare: {err}")
                else:
                    prepared[e.rollout_id] = resp
            if session.group_wide and len(prepared) < len(targets):
                if session.reused:
                    retry = list(targets)  # a member that restarted no longer holds the cached group
                elif prepared:
                    # One rollout that cannot take part (unreachable, no GPU, a GPU already in the
                    # group) must not hold back the others: they form a group without it.
                    retry = [by_id[rid] for rid in prepared]
                bad = [r for r in results.values() if r.rollout_id not in prepared]
                why = f"{bad[0].rollout_id}: {bad[0].error}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                for rid in prepared:
                    msg = f"{session.name}: not started: every member of the group must prepare, and {why}"
                    if retry:  # superseded by the retry's result: not a failure of this rollout
                        results[rid].ok, results[rid].error = False, msg
                    else:
                        self._fail(results[rid], by_id[rid], "transport", msg)
                prepared.clear()
            phases.add("prepare", time.perf_counter() - t_prepare)
            checksums: list[int] = []
            stream_ok, reason = False, "no target prepared"
            export = iter(self.actor.export_tensors()) if prepared else iter(())
            t_stream = time.perf_counter()
            if prepared:
                try:
                    sender = session.open({rid: by_id[rid] for rid in prepared}, left())
                    try:
                        stats = stream_buckets(manifest, export, sender, device=session.device, timeout=left())
                        checksums, stream_ok = stats.checksums, True
                    finally:
                        for rid, err in sender.failures().items():
                            if rid in prepared:
                                prepared.pop(rid)
                                self._fail(results[rid], by_id[rid], "transport", err)
                        sender.close()
                except Exception as exc:  # any failure to move bytes fails the targets, never the RPC
                    reason = f"stream: {exc}"
                    if not isinstance(exc, (OSError, TimeoutError, ValueError, RuntimeError)):
                        log.exception("sync %s: unexpected stream failure", sync_id)
                    for rid in list(prepared):
                        self._fail(results[rid], by_id[rid], "transport", f"{session.name} {reason}")
                    prepared.clear()
            session.finish(stream_ok, reason)
            # Multi-rank actors run collectives inside the exporter: drain it so every rank finishes.
            for _ in export:
                pass
            t_commit = time.perf_counter()
            phases.add("stream", t_commit - t_stream)
            commit = rollout_pb2.CommitSyncRequest(sync_id=sync_id, version=version)
            for i, c in enumerate(checksums):
                commit.checksums.add(index=i, checksum=c)
            for rid, fut in [(rid, pool.submit(self._call, by_id[rid], "CommitSync", commit)) for rid in prepared]:
                resp, err = fut.result()
                e, r = by_id[rid], results[rid]
                if err:
                    self._fail(r, e, "commit_failed", f"commit: {err}")
                else:
                    r.ok, r.version = True, resp.version
                    e.version, e.state, e.reachable, e.last_error = resp.version, rollout_pb2.SERVING, True, ""
                    e.origin = self.origin
            failed = [by_id[r.rollout_id] for r in results.values() if not r.ok]
            for f in [pool.submit(self._call, e, "AbortSync",
                                  rollout_pb2.AbortSyncRequest(sync_id=sync_id, reason="trainer aborted the sync"))
                      for e in failed]:
                f.result()
            phases.add("commit", time.perf_counter() - t_commit)
        finally:
            pool.shutdown(wait=True)
        return results, retry

    def is_current(self, entry: RolloutEntry) -> bool:
        return entry.origin == self.origin and entry.version == self.actor.version

    def _call(self, entry: RolloutEntry, method: str, request):
        try:
            return getattr(entry.stub(self.token, self.rpc_timeout), method)(request), ""
        except grpc.RpcError as exc:
            return None, describe_rpc_error(exc)

    def _fail(self, result: trainer_pb2.RolloutSyncResult, entry: RolloutEntry, reason: str, err: str) -> None:
        result.ok, result.error = False, err
        entry.last_error = err
        self.metrics.failure(reason)
        log.warning("sync to %s failed (%s): %s", entry.rollout_id, reason, err)


class PhaseClock:
    """Seconds spent in each named phase of one sync (a retried attempt adds to the same phases)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def __str__(self) -> str:
        return " ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items())
