"""rollout-svc settings (flags > env WS_ROLLOUT_* > --config file > defaults)."""
from __future__ import annotations

from dataclasses import dataclass

from weightsync.config import ConfigError, field, parse_host_port

ENV_PREFIX = "WS_ROLLOUT"


@dataclass
class RolloutConfig:
    grpc_address: str = field("127.0.0.1:50061", help="gRPC listen address, host:port")
    http_address: str = field("127.0.0.1:8091", help="HTTP listen address for /healthz, /readyz, /metrics")
    data_address: str = field("127.0.0.1:0", help="TCP weight-bus listen address (port 0 = pick a free port)")
    advertise_address: str = field("", help="gRPC address the trainer should dial (default: grpc_address)")
    advertise_data_host: str = field("", help="host the trainer should dial for the TCP bus (default: data_address host)")
    rollout_id: str = field("", help="stable id of this rollout (default: the advertised address)")
    trainer_address: str = field("", help="trainer gRPC address to register with (empty: wait to be listed by the trainer)")
    engine: str = field("builtin", choices=("builtin", "sglang"), help="inference engine")
    model: str = field("tiny-qwen2", help="HF model directory, or a built-in tiny config name (tiny-qwen2, tiny-llama, tiny-qwen3)")
    init_seed: int = field(4321, help="seed for random initialisation when --model is a config without weights")
    dtype: str = field("float32", choices=("float32", "bfloat16", "float16"), help="engine weight dtype")
    device: str = field("cpu", help="torch device of the built-in engine (cpu, cuda:0, ...)")
    tp: int = field(1, help="engine tensor-parallel size (sglang)")
    apply_mode: str = field("staged", choices=("staged", "inplace"),
                            help="staged: keep serving the old version while a sync streams, swap at commit "
                                 "(needs a copy of the weights); inplace: pause generation and load buckets as they "
                                 "arrive (no extra memory; a failed sync leaves the engine STALE until re-synced)")
    sync_timeout_s: float = field(300.0, help="a prepared sync not committed within this is aborted")
    register_timeout_s: float = field(120.0, help="give up registering with the trainer after this long (0 = forever)")
    heartbeat_s: float = field(10.0, help="re-register this often, so a restarted trainer finds this rollout (0 = once)")
    max_prefix_cache_entries: int = field(64, help="prefix KV cache capacity (prompts)")
    auth_token: str = field("", help="shared control-plane token (use auth_token_file in Kubernetes)")
    auth_token_file: str = field("", help="file holding the control-plane token (e.g. a mounted Secret)")
    log_level: str = field("INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level")
    log_format: str = field("text", choices=("text", "json"), help="log format")

    def validate(self) -> None:
        for name in ("grpc_address", "http_address", "data_address"):
            parse_host_port(name, getattr(self, name))
        if self.advertise_address:
            parse_host_port("advertise_address", self.advertise_address)
        if self.trainer_address:
            parse_host_port("trainer_address", self.trainer_address)
        if self.tp < 1:
            raise ConfigError(f"tp={self.tp} must be >= 1")
        if self.engine == "builtin" and self.tp != 1:
            raise ConfigError("engine=builtin runs one rank: set tp=1 or use engine=sglang")
        if self.sync_timeout_s <= 0:
            raise ConfigError("sync_timeout_s must be > 0")
        if self.auth_token and self.auth_token_file:
            raise ConfigError("set auth_token or auth_token_file, not both")
