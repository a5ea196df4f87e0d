"""Sync orchestration on the trainer: prepare every target → stream buckets → commit, or abort.

Targets succeed or fail individually: a rollout that rejects the manifest, drops off the bus or
fails its commit is aborted and reported, and the others still commit. Every rollout ends on a
complete version: the new one if it committed, otherwise the one it served before (or STALE,
refusing generation, in inplace mode — see rollout_svc.transaction).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from trainer_svc.registry import RolloutEntry, RolloutRegistry
from weightsync.bus.checksum import ALGO
from weightsync.bus.pipeline import stream_buckets
from weightsync.bus.plan import make_manifest, manifest_to_proto
from weightsync.bus.tcp import TcpBucketSender
from weightsync.bus.transport import TransportError
from weightsync.control.client import describe_rpc_error
from weightsync.obs.metrics import SyncMetrics
from weightsync.v1 import bus_pb2, rollout_pb2, trainer_pb2

log = logging.getLogger(__name__)


class SyncInProgress(RuntimeError):
    pass


class SyncOrchestrator:
    def __init__(self, actor, actor_lock: threading.Lock, registry: RolloutRegistry, metrics: SyncMetrics, *,
                 token: str, bucket_bytes: int, default_transport: str, sync_timeout: float, rpc_timeout: float,
                 origin: str):
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
        self.last_report = trainer_pb2.SyncReport()
        self.in_progress = False

    def sync(self, targets: list[RolloutEntry], transport: str = "", timeout: float = 0.0,
             wait_s: float = 0.0) -> trainer_pb2.SyncReport:
        transport = transport or self.default_transport
        timeout = timeout or self.sync_timeout
        if transport != "tcp":
            raise ValueError(f"transport={transport!r}: only tcp is wired into the control plane on this build "
                             "(nccl/ipc need the GPU bus; see docs/architecture.md)")
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
        version = self.actor.version
        sync_id = f"v{version}-{uuid.uuid4().hex[:12]}"
        manifest = make_manifest(self.actor.export_metas(), version=version, sync_id=sync_id,
                                 bucket_bytes=self.bucket_bytes, model_family=self.actor.family, checksum_algo=ALGO,
                                 origin=self.origin)
        report = trainer_pb2.SyncReport(sync_id=sync_id, version=version, transport=transport,
                                        bytes=manifest.total_bytes, num_buckets=len(manifest.buckets),
                                        num_tensors=manifest.num_tensors)
        results = {e.rollout_id: trainer_pb2.RolloutSyncResult(rollout_id=e.rollout_id) for e in targets}
        if not targets:
            report.ok = False
            log.warning("sync %s: no rollout registered", sync_id)
            self.last_report = report
            return report
        log.info("sync %s: version %d to %d rollout(s), %d tensors in %d buckets (%.1f MB) over %s", sync_id, version,
                 len(targets), manifest.num_tensors, len(manifest.buckets), manifest.total_bytes / 1e6, transport)
        prep = rollout_pb2.PrepareSyncRequest(manifest=manifest_to_proto(manifest), timeout_seconds=timeout)
        prep.transport.tcp.SetInParent()
        pool = ThreadPoolExecutor(max_workers=max(1, len(targets)), thread_name_prefix="sync-rpc")
        try:
            prepared: dict[str, str] = {}
            for e, fut in [(e, pool.submit(self._call, e, "PrepareSync", prep)) for e in targets]:
                resp, err = fut.result()
                if err:
                    self._fail(results[e.rollout_id], e, "prepare_failed", f"prepare: {err}")
                else:
                    prepared[e.rollout_id] = resp.transport.tcp.data_address
            by_id = {e.rollout_id: e for e in targets}
            checksums: list[int] = []
            export = iter(self.actor.export_tensors()) if prepared else iter(())
            if prepared:
                try:
                    sender = TcpBucketSender(prepared, sync_id, self.token, timeout=timeout)
                    try:
                        stats = stream_buckets(manifest, export, sender, timeout=timeout)
                        checksums = stats.checksums
                    finally:
                        for rid, err in sender.failures().items():
                            if rid in prepared:
                                prepared.pop(rid)
                                self._fail(results[rid], by_id[rid], "transport", err)
                        sender.close()
                except (TransportError, TimeoutError, OSError, ValueError) as exc:
                    for rid in list(prepared):
                        self._fail(results[rid], by_id[rid], "transport", f"stream: {exc}")
                    prepared.clear()
            # Multi-rank actors run collectives inside the exporter: drain it so every rank finishes.
            for _ in export:
                pass
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
        finally:
            pool.shutdown(wait=True)
        elapsed = time.perf_counter() - t0
        for r in results.values():
            r.seconds = elapsed
            by_id[r.rollout_id].last_sync_seconds = elapsed
        report.rollouts.extend(results.values())
        report.ok = all(r.ok for r in results.values())
        report.seconds = elapsed
        report.gbps = manifest.total_bytes / elapsed / 1e9 if elapsed > 0 else 0.0
        committed = sum(r.ok for r in results.values())
        self.metrics.sync_duration.observe(elapsed)
        self.metrics.sync_bytes.inc(manifest.total_bytes * committed)
        self.metrics.outcome("ok" if report.ok else ("partial" if committed else "failed"))
        log.info("sync %s: %d/%d committed in %.3fs (%.2f GB/s per receiver)", sync_id, committed, len(results),
                 elapsed, report.gbps)
        self.last_report = report
        return report

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
