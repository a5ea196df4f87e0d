"""Bounds on the work and memory a peer can ask of a rollout, checked before the work starts.

- Generate: a per-request budget (prompts, n, max_new_tokens and their product) and an admission
  gate: at most `max_inflight_requests` Generate/Score calls in the service at once, and at most
  `max_inflight_per_client` of them from one client connection, so one client cannot take every
  slot. A call over either bound is refused at once with RESOURCE_EXHAUSTED (it never queues
  behind the engine lock), which the client can retry with backoff.
- PrepareSync: the manifest's tensor count, total bytes and largest bucket are checked against
  the engine's own parameter count and size and `max_bucket_mb` from the raw message, before
  any per-tensor parsing or allocation; the raw request size is bounded too (`manifest_bytes_limit`),
  so a 10^6-tensor manifest costs a length check, not seconds of parsing.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

from weightsync.bus.errors import SyncError
from weightsync.config import ConfigError, field, require_positive

#: The manifest may carry a few tensors the engine does not list as parameters (fp8 scales, buffers);
#: anything beyond twice its own count plus this is not a manifest for this engine.
_EXTRA_TENSORS = 64
#: Largest element a manifest may carry (float32) and the per-tensor alignment padding of a bucket.
_MAX_ELEMENT_BYTES = 4
_ALIGN_SLACK = 256

#: The LimitsConfig fields that must be >= 1 (validate() checks them; the Helm schema states the same bound).
AT_LEAST_ONE = (
    "max_prompts",
    "max_n",
    "max_new_tokens",
    "max_request_tokens",
    "max_inflight_requests",
    "max_inflight_per_client",
    "max_bucket_mb",
    "max_bus_connections",
    "max_sync_links",
)


@dataclass
class LimitsConfig:
    """Bounds on what one request may ask of this rollout."""

    max_prompts: int = field(1024, help="Generate: most prompts in one request")
    max_n: int = field(64, help="Generate: most samples per prompt (sampling.n)")
    max_new_tokens: int = field(8192, help="Generate: largest sampling.max_new_tokens")
    max_request_tokens: int = field(
        1 << 20, help="Generate: most tokens one request may generate (prompts x n x max_new_tokens)"
    )
    max_inflight_requests: int = field(
        16, help="Generate/Score calls admitted at once; more are refused with RESOURCE_EXHAUSTED"
    )
    max_inflight_per_client: int = field(
        4,
        help="Generate/Score calls admitted at once from one client connection "
        "(fair share: one client cannot take every slot)",
    )
    max_bucket_mb: int = field(16384, help="largest weight-bus bucket a PrepareSync may declare, MiB")
    max_bus_connections: int = field(8, help="concurrent TCP weight-bus connections; extra ones are closed at once")
    max_sync_links: int = field(
        4,
        help="concurrent sync links (one per trainer that syncs this rollout); extra ones "
        "are closed at once and that trainer uses gRPC",
    )

    def validate(self) -> None:
        require_positive(self, AT_LEAST_ONE)
        if self.max_inflight_per_client > self.max_inflight_requests:
            raise ConfigError(
                f"max_inflight_per_client={self.max_inflight_per_client} must be <= "
                f"max_inflight_requests={self.max_inflight_requests}"
            )


class RequestRefused(SyncError):
    """A request over a configured bound; `code` is the gRPC status name."""


def check_generate(limits: LimitsConfig, num_prompts: int, n: int, max_new_tokens: int) -> None:
    """INVALID_ARGUMENT naming the limit when a Generate request asks for more than one request may."""
    for what, value, bound, knob in (
        ("prompts", num_prompts, limits.max_prompts, "max_prompts"),
        ("sampling.n", n, limits.max_n, "max_n"),
        ("sampling.max_new_tokens", max_new_tokens, limits.max_new_tokens, "max_new_tokens"),
    ):
        if value > bound:
            raise RequestRefused(
                f"{what}={value} exceeds this rollout's limit {knob}={bound}; split the request", "INVALID_ARGUMENT"
            )
    total = num_prompts * n * max_new_tokens
    if total > limits.max_request_tokens:
        raise RequestRefused(
            f"request asks for up to {total} generated tokens (prompts {num_prompts} x n {n} x "
            f"max_new_tokens {max_new_tokens}), over this rollout's limit "
            f"max_request_tokens={limits.max_request_tokens}; split it into smaller requests",
            "INVALID_ARGUMENT",
        )


class Admission:
    """A non-blocking gate on in-flight requests: a global cap and a per-client share of it."""

    def __init__(self, max_inflight: int, max_per_client: int):
        self.max_inflight = max_inflight
        self.max_per_client = max_per_client
        self._lock = threading.Lock()
        self._by_client: Counter[str] = Counter()
        self._total = 0

    @property
    def inflight(self) -> int:
        return self._total

    @contextmanager
    def admit(self, client: str):
        with self._lock:
            if self._by_client[client] >= self.max_per_client:
                raise RequestRefused(
                    f"this client already has {self._by_client[client]} requests in flight "
                    f"(max_inflight_per_client={self.max_per_client}); wait for one to finish",
                    "RESOURCE_EXHAUSTED",
                )
            if self._total >= self.max_inflight:
                raise RequestRefused(
                    f"rollout busy: {self._total} requests in flight "
                    f"(max_inflight_requests={self.max_inflight}); retry with backoff",
                    "RESOURCE_EXHAUSTED",
                )
            self._by_client[client] += 1
            self._total += 1
        try:
            yield
        finally:
            with self._lock:
                self._by_client[client] -= 1
                if self._by_client[client] <= 0:
                    del self._by_client[client]
                self._total -= 1


class ManifestLimits:
    """What a manifest for this engine can contain, derived once from the engine's parameters."""

    def __init__(self, param_metas: dict, max_bucket_mb: int):
        self.max_tensors = 2 * len(param_metas) + _EXTRA_TENSORS
        numel = sum(_prod(m.shape) for m in param_metas.values())
        self.max_total_bytes = (_MAX_ELEMENT_BYTES * numel + _ALIGN_SLACK * self.max_tensors) * 5 // 4 + (1 << 20)
        self.max_bucket_bytes = max_bucket_mb << 20
        # A serialized TensorEntry is its name plus under ~110 bytes of shape, offsets and tags.
        names = sum(len(n.encode()) for n in param_metas)
        self.max_request_bytes = 2 * (names + 128 * len(param_metas)) + (1 << 20)

    def check(self, manifest_pb) -> None:
        """INVALID_ARGUMENT before any per-tensor work: counts and sizes read from the bucket headers."""
        count = sum(b.num_tensors or len(b.tensors) for b in manifest_pb.buckets)  # runs expanded
        if count > self.max_tensors:
            raise RequestRefused(
                f"manifest has {count} tensors; this engine has far fewer parameters (at most "
                f"{self.max_tensors} tensors accepted): not a manifest for this model",
                "INVALID_ARGUMENT",
            )
        biggest = max((b.nbytes for b in manifest_pb.buckets), default=0)
        if biggest > self.max_bucket_bytes:
            raise RequestRefused(
                f"manifest declares a bucket of {biggest} bytes, over this rollout's max_bucket_mb="
                f"{self.max_bucket_bytes >> 20}; use a smaller trainer bucket_mb",
                "INVALID_ARGUMENT",
            )
        total = sum(b.nbytes for b in manifest_pb.buckets)
        if max(total, manifest_pb.total_bytes) > self.max_total_bytes:
            raise RequestRefused(
                f"manifest declares {max(total, manifest_pb.total_bytes)} bytes; this engine's model "
                f"is at most {self.max_total_bytes} bytes in float32 with padding: not a manifest "
                "for this model",
                "INVALID_ARGUMENT",
            )


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
