"""rollout-svc settings (flags > env WS_ROLLOUT_* > --config file > defaults), in sections.

Each knob keeps its flat name (flag `--apply-mode`, env `WS_ROLLOUT_APPLY_MODE`, file key
`apply_mode` or `bus: {apply_mode: ...}`); code reaches it through its section (`cfg.bus.apply_mode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_svc.limits import LimitsConfig
from weightsync.config import ConfigError, ServiceConfig, field, parse_host_port, require_positive, section
from weightsync.config_common import AuthConfig, DebugConfig, LogConfig, ServerConfig

ENV_PREFIX = "WS_ROLLOUT"


@dataclass
class InferenceConfig:
    """The inference engine and the model it serves."""

    engine: str = field("builtin", choices=("builtin", "sglang"), help="inference engine")
    model: str = field(
        "tiny-qwen2", help="HF model directory, or a built-in tiny config name (tiny-qwen2, tiny-llama, tiny-qwen3)"
    )
    init_seed: int = field(4321, help="seed for random initialisation when --model is a config without weights")
    dtype: str = field("float32", choices=("float32", "bfloat16", "float16"), help="engine weight dtype")
    device: str = field("cpu", help="torch device of the built-in engine (cpu, cuda:0, ...)")
    tp: int = field(1, help="engine tensor-parallel size (sglang)")
    receive_rank: int = field(
        0,
        help="engine=sglang, tp>1: the TP rank whose GPU rollout-svc receives buckets on (0: the first, the GPU a "
        "colocated trainer shares for ipc; over nccl a rank whose GPU is not the trainer's)",
    )
    max_prefix_cache_entries: int = field(64, help="prefix KV cache capacity (prompts)")
    sglang: dict[str, Any] = field(
        default_factory=dict,
        help="engine=sglang: options passed to SGLang's Engine (any sglang ServerArgs field, e.g. "
        "mem_fraction_static=0.6, context_length=8192, attention_backend=triton), checked against the "
        "installed SGLang at start; model_path, tp_size, dtype and base_gpu_id come from model, tp, dtype, device",
    )

    def validate(self) -> None:
        require_positive(self, ("tp",))
        if self.engine == "builtin" and self.tp != 1:
            raise ConfigError("engine=builtin runs one rank: set tp=1 or use engine=sglang")
        if not 0 <= self.receive_rank < self.tp:
            raise ConfigError(f"receive_rank={self.receive_rank} must be a TP rank: 0 <= receive_rank < tp={self.tp}")
        if self.sglang and self.engine != "sglang":
            raise ConfigError(
                f"sglang options {sorted(self.sglang)} are set but engine={self.engine}: set engine=sglang"
            )
        if self.max_prefix_cache_entries < 0:
            raise ConfigError(f"max_prefix_cache_entries={self.max_prefix_cache_entries} must be >= 0 (0 = no cache)")


@dataclass
class RolloutBusConfig:
    """The receiving end of the weight bus: TCP listener and how a sync is applied."""

    data_address: str = field("127.0.0.1:0", help="TCP weight-bus listen address (port 0 = pick a free port)")
    advertise_data_host: str = field(
        "", help="host the trainer should dial for the TCP bus (default: data_address host)"
    )
    apply_mode: str = field(
        "staged",
        choices=("staged", "inplace"),
        help="staged: keep serving the old version while a sync streams, swap at commit "
        "(needs a copy of the weights); inplace: pause generation and load buckets as they "
        "arrive (no extra memory; a failed sync leaves the engine STALE until re-synced)",
    )
    sync_timeout_s: float = field(300.0, help="a prepared sync not committed within this is aborted")
    sync_link: bool = field(
        True,
        help="offer the trainer the sync link on the data port: later PrepareSync, "
        "CommitSync and AbortSync as frames on one authenticated connection "
        "instead of gRPC calls (saves most of their round trips); false: gRPC only",
    )
    delta_base: bool = field(
        True,
        help="keep a copy of the last version committed over tcp (host memory) or over nccl with "
        "sync_encoding=delta (the rollout's GPU): one copy of the model's export bytes, so the trainer may "
        "send only the changed values (sync_encoding delta/auto); false: every sync is sent in full",
    )

    def validate(self) -> None:
        parse_host_port("data_address", self.data_address)
        if self.sync_timeout_s <= 0:
            raise ConfigError("sync_timeout_s must be > 0")


@dataclass
class RegistrationConfig:
    """How this rollout is found by the trainer."""

    advertise_address: str = field("", help="gRPC address the trainer should dial (default: grpc_address)")
    rollout_id: str = field("", help="stable id of this rollout (default: the advertised address)")
    trainer_address: str = field(
        "", help="trainer gRPC address to register with (empty: wait to be listed by the trainer)"
    )
    register_timeout_s: float = field(120.0, help="give up registering with the trainer after this long (0 = forever)")
    heartbeat_s: float = field(
        10.0, help="re-register this often, so a restarted trainer finds this rollout (0 = once)"
    )
    trainer_id: str = field(
        "",
        help="accept syncs only from the trainer with this id (its own --trainer-id); empty: "
        "follow the trainer this rollout registers with, else the first to commit a sync",
    )
    serve_initial_weights: bool = field(
        False,
        help="report ready (/readyz 200) on the engine's own initial weights "
        "before any sync; default: ready only once a sync from the "
        "trainer committed (a rejoining rollout is caught up first)",
    )

    def validate(self) -> None:
        if self.register_timeout_s < 0:
            raise ConfigError(f"register_timeout_s={self.register_timeout_s} must be >= 0 (0 = keep trying forever)")
        if self.heartbeat_s < 0:
            raise ConfigError(f"heartbeat_s={self.heartbeat_s} must be >= 0 (0 = register once)")
        if self.advertise_address:
            parse_host_port("advertise_address", self.advertise_address)
        if self.trainer_address:
            parse_host_port("trainer_address", self.trainer_address)


@dataclass
class RolloutAuthConfig(AuthConfig):
    """The control-plane token, and the narrower generation key handed to inference clients."""

    generation_token: str = field(
        "",
        secret=True,
        help="a key that grants only generation: the OpenAI routes (/v1/...) and the Generate and Score RPCs, "
        "never sync, load or abort (those need auth_token, which grants everything). Env or config file only; "
        "generation_token_file in Kubernetes",
    )
    generation_token_file: str = field("", help="file holding the generation key (e.g. a mounted Secret)")

    def validate(self) -> None:
        super().validate()
        if self.generation_token and self.generation_token_file:
            raise ConfigError("set generation_token or generation_token_file, not both")
        if (self.generation_token or self.generation_token_file) and not (self.auth_token or self.auth_token_file):
            raise ConfigError(
                "generation_token(_file) needs auth_token or auth_token_file: without an admin token every call "
                "is open, and a generation key would restrict nothing"
            )


@dataclass
class RolloutConfig(ServiceConfig):
    server: ServerConfig = section(ServerConfig, grpc_address="127.0.0.1:50061", http_address="127.0.0.1:8091")
    inference: InferenceConfig = section(InferenceConfig)
    bus: RolloutBusConfig = section(RolloutBusConfig)
    registration: RegistrationConfig = section(RegistrationConfig)
    limits: LimitsConfig = section(LimitsConfig)
    auth: RolloutAuthConfig = section(RolloutAuthConfig)
    log: LogConfig = section(LogConfig)
    debug: DebugConfig = section(DebugConfig)
