"""Config sections both services share: listen addresses, control-plane auth, logging.

Each service embeds them with `section(...)` (trainer-svc and rollout-svc differ only in default
ports), so a shared knob has one definition, one help text and one validation.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.config import ConfigError, field, parse_host_port

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass
class ServerConfig:
    """Where the service listens."""

    grpc_address: str = field("127.0.0.1:50051", help="gRPC listen address (control plane), host:port")
    http_address: str = field("127.0.0.1:8081", help="HTTP listen address for /healthz, /readyz, /metrics")

    def validate(self) -> None:
        parse_host_port("grpc_address", self.grpc_address)
        parse_host_port("http_address", self.http_address)


@dataclass
class AuthConfig:
    """The shared control-plane token."""

    auth_token: str = field(
        "",
        secret=True,
        help="shared control-plane token; when set, every RPC must carry it. Env or config file "
        "only (never a flag, which any local user could read in the process list); "
        "auth_token_file in Kubernetes",
    )
    auth_token_file: str = field("", help="file holding the control-plane token (e.g. a mounted Secret)")
    insecure: bool = field(
        False,
        help="allow listening beyond loopback without a token (logged as a WARNING); "
        "without it a service with a non-loopback address and no token refuses to start",
    )

    def validate(self) -> None:
        if self.auth_token and self.auth_token_file:
            raise ConfigError("set auth_token or auth_token_file, not both")


@dataclass
class LogConfig:
    """Process logging."""

    log_level: str = field("INFO", choices=LOG_LEVELS, help="log level")
    log_format: str = field(
        "text", choices=("text", "json"), help="log format; json gives one structured object per line"
    )

    def validate(self) -> None:
        pass


@dataclass
class DebugConfig:
    """Debug and tuning switches (weightsync/debug.py): off by default, for diagnosis and tests."""

    fp8_gpu_convert: bool = field(
        True,
        help="block-FP8 kernels on sm_89+ round with the GPU's conversion instructions; false: the bit arithmetic "
        "(the same bytes, docs/architecture.md)",
    )
    profile_syncs: str = field(
        "", help="a path: write each sync's host time by function there (pstats; slower syncs); empty: off"
    )
    nccl_library: str = field(
        "", help="the libnccl.so to load first (before the nvidia.nccl wheel's and the system's); empty: search"
    )
    nccl_bus: str = field(
        "",
        help="module:attr of a stand-in NCCL bus (tests only, e.g. tests.support.gloo_nccl:GlooNcclBus); "
        "empty: libnccl",
    )

    sglang_peer_reads: bool = field(
        True,
        help="SGLang at tp_size > 1: each rank opens the bucket on its own GPU and reads its shards; false: SGLang "
        "moves the whole bucket to every rank first (rollout only)",
    )
    sglang_rollout_writes: bool = field(
        True,
        help="SGLang: rollout-svc writes NCCL/TCP buckets into the parameters SGLang exported; false: every bucket "
        "through SGLang's worker (rollout only)",
    )

    def validate(self) -> None:
        if self.nccl_bus and ":" not in self.nccl_bus:
            raise ConfigError(f"nccl_bus={self.nccl_bus!r} must be module:attr (a stand-in bus for tests), or empty")

    def switches(self):
        """This section as the process's switches (weightsync.debug.configure takes them)."""
        from weightsync.debug import Switches

        return Switches(
            fp8_gpu_convert=self.fp8_gpu_convert,
            profile_syncs=self.profile_syncs,
            nccl_library=self.nccl_library,
            nccl_bus=self.nccl_bus,
            sglang_peer_reads=self.sglang_peer_reads,
            sglang_rollout_writes=self.sglang_rollout_writes,
        )
