"""Prometheus metrics of both services, in base units, on a per-service registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SYNC_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class SyncMetrics:
    """Metrics both sides of a sync report; `role` is 'trainer' or 'rollout'."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.sync_duration = Histogram("weightsync_sync_duration_seconds",
                                       "Wall time of a sync: trainer from Sync call to last commit; rollout from "
                                       "prepare to commit", ["role"], buckets=_SYNC_BUCKETS, registry=r).labels(role)
        self.sync_phase = Histogram("weightsync_sync_phase_seconds",
                                    "Wall time of each phase of a sync (trainer: plan, prepare, stream, commit)",
                                    ["role", "phase"], buckets=_PHASE_BUCKETS, registry=r)
        self.sync_bytes = Counter("weightsync_sync_bytes_total", "Weight bytes moved by committed and failed syncs "
                                  "(trainer: per receiver)", ["role"], registry=r).labels(role)
        self.syncs = Counter("weightsync_syncs_total", "Syncs by outcome", ["role", "outcome"], registry=r)
        self.failures = Counter("weightsync_sync_failures_total", "Failed syncs (per rollout on the trainer) by reason",
                                ["role", "reason"], registry=r)
        self.version = Gauge("weightsync_weights_version", "Version of the weights held (trainer) or served (rollout)",
                             ["role"], registry=r).labels(role)
        self.in_progress = Gauge("weightsync_sync_in_progress", "1 while a sync is running", ["role"],
                                 registry=r).labels(role)
        self.role = role

    def outcome(self, outcome: str) -> None:
        self.syncs.labels(self.role, outcome).inc()

    def failure(self, reason: str) -> None:
        self.failures.labels(self.role, reason).inc()
