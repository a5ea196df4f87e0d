"""`SyncOptions`: how a publisher syncs, as one frozen object, in one set of units (bytes, seconds).

trainer-svc builds it from its config's `bus` section (trainer_svc/config.py `BusConfig.sync_options`),
a `Publisher` from its keyword arguments or the `options=` it is given; either way it travels whole,
PublisherHost.publish → SyncOrchestrator. The defaults live here once: the config's fields in
their own units (MiB) are derived from them. Importing it is cheap (no torch): the config imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from weightsync.bus.transports import TRANSPORTS, choices

MIB = 1 << 20
#: who streams the buckets (trainer-svc's `senders`)
SENDERS = ("all", "rank0")
ENCODINGS = ("full", "delta", "auto")
#: weightsync.bus.ipc.trainer_writes.DIRECTIONS (that module imports torch; a test holds the two equal)
IPC_DIRECTIONS = ("auto", "rollout_reads", "trainer_writes")
#: the transports that carry deltas (weightsync/publisher/delta_sync.py)
DELTA_TRANSPORTS = ("tcp", "nccl")
#: the largest bucket a sync plans (16 GiB), and the smallest (weightsync.bus.plan.ALIGN: offsets are
#: aligned to 256 bytes)
MAX_BUCKET_BYTES = 16384 * MIB
MIN_BUCKET_BYTES = 256


@dataclass(frozen=True)
class SyncOptions:
    #: the transport of a Sync call that names none
    transport: str = "tcp"
    #: the flat bucket size; two buckets are the sender's extra memory
    bucket_bytes: int = 1024 * MIB
    #: a sync that has not committed on a rollout within this is aborted there
    sync_timeout_s: float = 300.0
    #: each control-plane RPC to a rollout
    rpc_timeout_s: float = 30.0
    #: bound on building an NCCL group
    nccl_init_timeout_s: float = 120.0
    #: a rollout silent this long on its sync link is gone (its part of the sync fails at once)
    liveness_timeout_s: float = 3.0
    #: PrepareSync / CommitSync / AbortSync over the sync link a rollout offers (False: gRPC only)
    sync_link: bool = True
    #: all: every rank that assembles tensors streams its own; rank0: the funnel
    senders: str = "all"
    #: full, delta or auto (docs/architecture.md "Delta syncs")
    sync_encoding: str = "auto"
    #: bound on the copy of the last committed export kept for delta syncs (0: none, no delta)
    delta_base_bytes: int = 32768 * MIB
    #: auto over nccl sends deltas while the measured link is below this many Gb/s (0: never)
    delta_link_gbps: float = 400.0
    #: ipc: who moves the bytes (auto, rollout_reads, trainer_writes)
    ipc_direction: str = "auto"
    #: what the export puts on the wire: "" (the actor's dtype) or a format name such as fp8-block
    export_dtype: str = ""
    #: where the trainer's export lives: cpu, cuda or cuda:N (trainer-svc: its actor's parameters' device)
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            _bad("transport", self.transport, f"must be {choices()}")
        if not MIN_BUCKET_BYTES <= self.bucket_bytes <= MAX_BUCKET_BYTES:
            _bad(
                "bucket_bytes",
                self.bucket_bytes,
                f"must be in [{MIN_BUCKET_BYTES}, {MAX_BUCKET_BYTES}] bytes (trainer-svc: bucket_mb in [1, 16384])",
            )
        for name in ("sync_timeout_s", "rpc_timeout_s", "nccl_init_timeout_s", "liveness_timeout_s"):
            value = getattr(self, name)  # this dataclass's own fields, by name
            if not (value > 0 and math.isfinite(value)):
                _bad(name, value, "must be a finite number of seconds > 0")
        if self.senders not in SENDERS:
            _bad("senders", self.senders, f"must be {choices(SENDERS)}")
        if self.sync_encoding not in ENCODINGS:
            _bad("sync_encoding", self.sync_encoding, f"must be {choices(ENCODINGS)}")
        if self.sync_encoding == "delta" and self.transport not in DELTA_TRANSPORTS:
            _bad(
                "sync_encoding",
                "delta",
                f"is carried by transports {choices(DELTA_TRANSPORTS)} only (transport={self.transport}): "
                "use sync_encoding=auto, which picks full there",
            )
        if self.delta_base_bytes < 0:
            _bad("delta_base_bytes", self.delta_base_bytes, "must be >= 0 (0: keep no copy, every sync in full)")
        if not self.delta_link_gbps >= 0:  # NaN too
            _bad(
                "delta_link_gbps",
                self.delta_link_gbps,
                "must be >= 0 (Gb/s below which auto sends deltas over nccl; 0: auto stays full on nccl)",
            )
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            _bad("device", self.device, "must be cpu, cuda or cuda:N")
        if self.ipc_direction not in IPC_DIRECTIONS:
            _bad("ipc_direction", self.ipc_direction, f"must be {choices(IPC_DIRECTIONS)}")

    @property
    def bucket_mb(self) -> int:
        return self.bucket_bytes // MIB

    def but(self, **changes) -> SyncOptions:
        """A copy with `changes` (validated as a new object is)."""
        return replace(self, **changes)


def _bad(name: str, value, why: str) -> None:
    raise ValueError(f"SyncOptions.{name}={value!r} {why}")


DEFAULTS = SyncOptions()
