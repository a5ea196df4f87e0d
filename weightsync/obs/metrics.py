"""Every Prometheus metric family of both services, in base units, on a per-service registry.

Each weightsync family carries a `role` label ('trainer' or 'rollout'), so one dashboard query can
select a side and a family shared by both sides (e.g. `weightsync_nccl_group_builds_total`) is
defined once. A family only one side reports is made only on that side's registry (by the classes
below, or SyncMetrics' trainer-only part), so neither side exports the other's empty families.

A service's registry (`service_registry`) also carries the standard `process_*` and `python_*`
collectors, and exposes no `_created` series: in the text format Prometheus scrapes, each would be
a gauge twin of every counter and histogram series that no query or alert here needs. That is per
registry, not prometheus_client's global switch, so a library user's own registries keep its defaults.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

_SYNC_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TRAIN_SECONDS_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300)
# one request: a few decode steps of a tiny model up to a long sample of a large one
_GENERATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# the `endpoint` label of the generation families: one per API that generates
ENDPOINTS = ("grpc_generate", "http_completions", "http_chat_completions")
# the sample types that prometheus_client gives a `_created` twin
_CREATED_TYPES = frozenset({"counter", "histogram", "summary"})


class ServiceRegistry(CollectorRegistry):
    """A service's registry: collects without the `_created` samples of counters and histograms."""

    def collect(self) -> Iterable[Metric]:
        for fam in super().collect():
            created = fam.name + "_created"
            if fam.type not in _CREATED_TYPES or not any(s.name == created for s in fam.samples):
                yield fam
                continue
            # a copy: a custom collector may hand out the same Metric on every scrape
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [s for s in fam.samples if s.name != created]
            yield out


def service_registry() -> ServiceRegistry:
    """A registry with the process (CPU, memory, fds, start time), platform (python_info) and GC collectors."""
    r = ServiceRegistry()
    ProcessCollector(registry=r)
    PlatformCollector(registry=r)
    GCCollector(registry=r)
    return r


class SyncMetrics:
    """Metrics both sides of a sync report; `role` is 'trainer' or 'rollout'. The trainer's
    per-sender and per-call families exist only on a trainer's registry."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None):
        if role not in ("trainer", "rollout"):
            raise ValueError(f"role={role!r} must be 'trainer' or 'rollout'")
        self.registry = registry or service_registry()
        r = self.registry
        #: by role and route: the trainer's syncs by the path they took (weightsync/publisher/route.py,
        #: a small closed set); a rollout's with route "" (it does not pick one)
        self.sync_duration = Histogram(
            "weightsync_sync_duration_seconds",
            "Wall time of a sync: trainer from Sync call to last commit; rollout from prepare to commit",
            ["role", "route"],
            buckets=_SYNC_BUCKETS,
            registry=r,
        )
        self.sync_bytes = Counter(
            "weightsync_sync_bytes_total",
            "Weight bytes moved by committed and failed syncs (trainer: per receiver)",
            ["role"],
            registry=r,
        ).labels(role)
        self.sync_wire_bytes = Counter(
            "weightsync_sync_wire_bytes_total",
            "Bytes syncs put on the bus (trainer: summed over rollouts, frames included), by encoding: "
            "full (dense buckets) or delta (changed words only)",
            ["role", "encoding"],
            registry=r,
        )
        self.syncs = Counter("weightsync_syncs_total", "Syncs by outcome", ["role", "outcome"], registry=r)
        self.failures = Counter(
            "weightsync_sync_failures_total",
            "Failed syncs (per rollout on the trainer) by reason",
            ["role", "reason"],
            registry=r,
        )
        self.version = Gauge(
            "weightsync_weights_version",
            "Version of the weights held (trainer) or served (rollout)",
            ["role"],
            registry=r,
        ).labels(role)
        self.in_progress = Gauge(
            "weightsync_sync_in_progress", "1 while a sync is running", ["role"], registry=r
        ).labels(role)
        self.nccl_group_builds = Counter(
            "weightsync_nccl_group_builds_total",
            "NCCL groups built (trainer) or joined (rollout); a sync that reuses the cached group adds none",
            ["role"],
            registry=r,
        ).labels(role)
        self.rollbacks = Counter(
            "weightsync_sync_rollbacks_total",
            "Syncs to a lower version allowed by an explicit allow_rollback (trainer: requested; rollout: applied)",
            ["role"],
            registry=r,
        ).labels(role)
        self.role = role
        if role == "trainer":
            self._trainer_families(r)

    def _trainer_families(self, r: CollectorRegistry) -> None:
        self.sync_phase = Histogram(
            "weightsync_sync_phase_seconds",
            "Wall time of each phase of a sync (trainer: plan, prepare, stream, commit), by the sync's route",
            ["role", "phase", "route"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        # trainer: the per-sender split of the stream, so an operator sees one rank holding the rest back
        self.sender_bytes = Counter(
            "weightsync_sync_sender_bytes_total",
            "Tensor bytes each trainer rank streamed as a bus sender (its own buckets, "
            "counted once per sync, not per receiver)",
            ["role", "rank"],
            registry=r,
        )
        self.sender_seconds = Histogram(
            "weightsync_sync_sender_seconds",
            "Wall time of each trainer rank's stream (export + pack + send)",
            ["role", "rank"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.forwarded_bytes = Counter(
            "weightsync_sync_forwarded_bytes_total",
            "Bytes of other ranks' tensors that a sender received to send them on "
            "(the rank-0 funnel; 0 with multi-sender streaming)",
            ["role", "rank"],
            registry=r,
        )
        self.sender_buffer_bytes = Gauge(
            "weightsync_sync_sender_buffer_bytes",
            "Each trainer rank's reusable pack buffers in its last sync (two buckets "
            "at most): with the tensor it is assembling, its extra memory",
            ["role", "rank"],
            registry=r,
        )
        self.nccl_link_rate = Gauge(
            "weightsync_nccl_link_bytes_per_second",
            "The NCCL link's rate as the last full nccl sync measured it (its fastest bucket's bytes per "
            "second; 0: none measured yet): sync_encoding=auto sends deltas over nccl below delta_link_gbps",
            ["role"],
            registry=r,
        ).labels(self.role)
        self.calls = Counter(
            "weightsync_sync_calls_total",
            "PrepareSync, CommitSync and AbortSync calls the trainer made, by path: link (the "
            "rollout's sync link) or grpc (the first of a pairing, no link offered, or a link "
            "that could not be opened)",
            ["role", "method", "path"],
            registry=r,
        )

    def outcome(self, outcome: str) -> None:
        self.syncs.labels(self.role, outcome).inc()

    def failure(self, reason: str) -> None:
        self.failures.labels(self.role, reason).inc()


class RolloutMetrics:
    """What only a rollout reports: serving and applying weights."""

    role = "rollout"

    def __init__(self, registry: CollectorRegistry):
        r, role = registry, self.role
        self.requests = Counter(
            "weightsync_generate_requests_total", "Generate requests by outcome", ["role", "outcome"], registry=r
        )
        self.refused = Counter(
            "weightsync_requests_refused_total",
            "Generate/Score requests refused before any "
            "work, by the limit they hit (budget: over a per-request limit; busy: admission full)",
            ["role", "reason"],
            registry=r,
        )
        self.prefix_hits = Counter(
            "weightsync_prefix_cache_hits_total",
            "Samples whose prompt prefill came from the prefix cache",
            ["role"],
            registry=r,
        ).labels(role)
        self.apply_seconds = Histogram(
            "weightsync_apply_seconds", "Time generation was paused to load weights at commit", ["role"], registry=r
        ).labels(role)
        self.state = Gauge(
            "weightsync_rollout_state", "Engine state (1 for the current state)", ["role", "state"], registry=r
        )
        #: show_state's series by state name (looked up once), the state shown now, and their lock (the
        #: transaction's changes come from the RPC threads and its timeout's)
        self._states: dict[str, Any] | None = None
        self._shown = ""
        self._state_lock = threading.Lock()
        self.ipc_mappings = Gauge(
            "weightsync_ipc_mapped_buffers",
            "Trainer buffers this rollout holds mapped by CUDA IPC (kept across syncs)",
            ["role"],
            registry=r,
        ).labels(role)
        self.ipc_opens = Counter(
            "weightsync_ipc_handle_opens_total",
            "CUDA IPC handles this rollout mapped; a steady-state sync maps none",
            ["role"],
            registry=r,
        ).labels(role)
        # colocated RL (ReleaseMemory): the engine's GPU memory handed to the trainer between syncs
        self.memory_releases = Counter(
            "weightsync_memory_releases_total",
            "ReleaseMemory calls by outcome (refused: a sync in progress, requests still running, engine cannot)",
            ["role", "outcome"],
            registry=r,
        )
        for outcome in ("ok", "refused"):
            self.memory_releases.labels(role, outcome)
        self.memory_released = Gauge(
            "weightsync_memory_released",
            "1 while the engine's GPU memory is released (generation refused until the next sync commits)",
            ["role"],
            registry=r,
        ).labels(role)
        # generation requests by endpoint (ENDPOINTS): gRPC Generate, HTTP completions
        self.generation_seconds = Histogram(
            "weightsync_generation_duration_seconds",
            "Wall time of a completed generation request, admission and queueing included",
            ["role", "endpoint"],
            buckets=_GENERATION_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "weightsync_prompt_tokens_total",
            "Prompt tokens of completed generation requests (each prompt once, whatever n)",
            ["role", "endpoint"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "weightsync_completion_tokens_total",
            "Tokens generated for completed generation requests (every sample)",
            ["role", "endpoint"],
            registry=r,
        )
        self.in_flight = Gauge(
            "weightsync_generation_requests_in_flight",
            "Generation requests being served now (admitted, queued or running)",
            ["role", "endpoint"],
            registry=r,
        )
        for endpoint in ENDPOINTS:  # every series from the start, so rate() and dashboards see 0, not nothing
            for fam in (self.generation_seconds, self.prompt_tokens, self.completion_tokens, self.in_flight):
                fam.labels(role, endpoint)

    def memory_release(self, outcome: str) -> None:
        self.memory_releases.labels(self.role, outcome).inc()

    def request(self, outcome: str) -> None:
        self.requests.labels(self.role, outcome).inc()

    def set_state(self, name: str, current: bool) -> None:
        self.state.labels(self.role, name).set(1 if current else 0)

    def show_state(self, current: str, names: Iterable[str]) -> None:
        """1 for the engine state `current`, 0 for the other `names`. Runs at every prepare and commit
        (60 us a call when every state's series was looked up and written, bench/bench_sync_fixed_cost.py):
        the series are looked up once and only the two whose value changes are written."""
        with self._state_lock:
            if self._states is None:
                self._states = {n: self.state.labels(self.role, n) for n in names}
                for n, series in self._states.items():
                    series.set(1 if n == current else 0)
            elif current != self._shown:
                for n, value in ((self._shown, 0), (current, 1)):
                    if n in self._states:  # a state outside `names` (none: the proto's 0) shows as all 0
                        self._states[n].set(value)
            self._shown = current

    @contextmanager
    def generation(self, endpoint: str) -> Iterator[Callable[[int, int], None]]:
        """Count one generation request in flight while the block runs; the block calls the yielded
        `done(prompt_tokens, completion_tokens)` once it has the answer, which records the latency
        and the tokens. A request that raises, or never calls `done`, adds neither (its outcome is
        in weightsync_generate_requests_total)."""
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint={endpoint!r} must be one of {ENDPOINTS} (add it there first)")
        started = time.perf_counter()
        gauge = self.in_flight.labels(self.role, endpoint)

        def done(prompt_tokens: int, completion_tokens: int) -> None:
            self.generation_seconds.labels(self.role, endpoint).observe(time.perf_counter() - started)
            self.prompt_tokens.labels(self.role, endpoint).inc(prompt_tokens)
            self.completion_tokens.labels(self.role, endpoint).inc(completion_tokens)

        gauge.inc()
        try:
            yield done
        finally:
            gauge.dec()


class TrainerMetrics:
    """What only a trainer reports about its fleet."""

    role = "trainer"

    def __init__(self, registry: CollectorRegistry):
        self.registered_rollouts = Gauge(
            "weightsync_registered_rollouts", "Rollouts registered with this trainer", ["role"], registry=registry
        ).labels(self.role)


class TrainMetrics:
    """The training calls (TrainStep), registered on the trainer's registry."""

    role = "trainer"

    def __init__(self, registry: CollectorRegistry):
        r, role = registry, self.role

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["role"], registry=r).labels(role)

        self.steps = Counter(
            "weightsync_train_steps_total", "Optimizer steps taken by TrainStep", ["role"], registry=r
        ).labels(role)
        self.step = gauge("weightsync_train_step", "Trainer step counter (restored by --resume)")
        self.step_seconds = Histogram(
            "weightsync_train_step_duration_seconds",
            "Wall time of one TrainStep",
            ["role"],
            buckets=_TRAIN_SECONDS_BUCKETS,
            registry=r,
        ).labels(role)
        self.loss = gauge("weightsync_train_loss", "Loss of the last TrainStep")
        self.reward = gauge("weightsync_train_reward_mean", "Mean reward of the last TrainStep's samples")
        self.grad_norm = gauge("weightsync_train_grad_norm", "Global grad norm of the last step (before clipping)")
        # the train/inference gap: |rollout log-prob - trainer log-prob| on the sampled tokens, taken
        # before the update; it measures numerics when the samples came from the current version
        self.mismatch_max = gauge(
            "weightsync_train_inference_logprob_diff_max",
            "Max |rollout - trainer| log-prob on the last TrainStep's sampled tokens",
        )
        self.mismatch_mean = gauge(
            "weightsync_train_inference_logprob_diff_mean",
            "Mean |rollout - trainer| log-prob on the last TrainStep's sampled tokens",
        )

    def observe(self, step: int, m: dict[str, float]) -> None:
        self.steps.inc()
        self.step.set(step)
        self.step_seconds.observe(m.get("step_seconds", 0.0))
        self.loss.set(m.get("loss", 0.0))
        self.reward.set(m.get("reward_mean", 0.0))
        self.grad_norm.set(m.get("grad_norm", 0.0))
        if m.get("rollout_logprobs_given"):
            self.mismatch_max.set(m.get("logprob_diff_max", 0.0))
            self.mismatch_mean.set(m.get("logprob_diff_mean", 0.0))


class AuthFailures(Collector):
    """`weightsync_auth_failures_total{role, surface}`: control-plane calls refused for their token, read
    from the server's own count (`read`) at each scrape, so the refusal path touches no metric."""

    def __init__(self, role: str, read: Callable[[], int], registry: CollectorRegistry):
        self.role, self.read = role, read
        registry.register(self)

    def collect(self) -> Iterable[Metric]:
        fam = CounterMetricFamily(
            "weightsync_auth_failures",
            "Control-plane calls refused for a missing, wrong or out-of-scope token, by surface (grpc)",
            labels=["role", "surface"],
        )
        fam.add_metric([self.role, "grpc"], self.read())
        yield fam
