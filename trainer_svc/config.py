"""trainer-svc settings (flags > env WS_TRAINER_* > --config file > defaults)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from trainer_svc.megatron.bridge_contract import CONTRACTS, missing_package_error
from weightsync.config import ConfigError, field, parse_host_port

ENV_PREFIX = "WS_TRAINER"


@dataclass
class TrainerConfig:
    grpc_address: str = field("127.0.0.1:50051", help="gRPC listen address (control plane and admin API), host:port")
    http_address: str = field("127.0.0.1:8081", help="HTTP listen address for /healthz, /readyz, /metrics")
    backend: str = field("megatron", choices=("megatron", "hf"),
                         help="model backend: megatron (megatron-core GPTModel) or hf (transformers, one process)")
    model: str = field("tiny-qwen2", help="HF model directory, or a built-in tiny config name (tiny-qwen2, tiny-llama, tiny-qwen3)")
    init_seed: int = field(1234, help="seed for random initialisation when --model is a config without weights")
    tp: int = field(1, help="tensor-parallel size (must equal the torchrun world size / PP / VPP product)")
    pp: int = field(1, help="pipeline-parallel size")
    vpp: int = field(1, help="virtual pipeline stages per PP rank")
    ep: int = field(1, help="expert-parallel size for MoE models (experts split over ep ranks; world size must be a multiple of ep*pp)")
    mtp: str = field("off", choices=("off", "deepseek", "mimo"),
                     help="carry the model's multi-token-prediction layers (num_nextn_predict_layers in its config) and publish them under DeepSeek-V3 (model.layers.N+i.*) or MiMo (model.mtp_layers.i.*) names")
    export_dtype: str = field("float32", choices=("float32", "bfloat16", "float16"),
                              help="dtype tensors are cast to on the bus (match the rollout engine's dtype)")
    converter: str = field("builtin", choices=("builtin", *CONTRACTS),
                           help="backend=megatron: what maps Megatron <-> HF tensors for export and load: builtin "
                                "(the rule tables) or a bridge package when installed (mbridge, megatron-bridge; "
                                "dense qwen2/llama/qwen3; docs/conversion.md)")
    device: str = field("", help="torch device of backend hf's model and export (cpu, cuda, cuda:N; empty = cpu); "
                                 "backend megatron always uses cuda:LOCAL_RANK when CUDA is available. "
                                 "Transports nccl and ipc need a CUDA device")
    transport: str = field("tcp", choices=("tcp", "nccl", "ipc"),
                           help="default weight-bus transport: tcp (any host), nccl (trainer and rollouts on GPUs), "
                                "ipc (rollouts on the trainer's own GPU)")
    nccl_init_timeout_s: float = field(120.0, help="bound on building an NCCL group (every rollout must join within "
                                                   "it, and within the sync timeout)")
    bucket_mb: int = field(1024, help="flat bucket size in MiB (1024 measured best on NVLink, docs/BENCHMARKS.md); two buckets are the sender's extra memory")
    sync_timeout_s: float = field(300.0, help="a sync that has not committed on a rollout within this is aborted there")
    rpc_timeout_s: float = field(30.0, help="timeout of each control-plane RPC to a rollout")
    rollouts: list[str] = field(default_factory=list,
                                help="static rollout addresses host:port (comma-separated); rollouts may also register themselves")
    auto_sync_new_rollouts: bool = field(True, help="bring a newly registered rollout to the current version automatically")
    auth_token: str = field("", help="shared control-plane token; when set, every RPC must carry it (use auth_token_file in Kubernetes)")
    auth_token_file: str = field("", help="file holding the control-plane token (e.g. a mounted Secret)")
    lr: float = field(1e-6, help="optimizer learning rate (AdamW)")
    lr_warmup_steps: int = field(0, help="linear LR warm-up steps, then constant")
    weight_decay: float = field(0.0, help="AdamW weight decay")
    adam_beta1: float = field(0.9, help="AdamW beta1")
    adam_beta2: float = field(0.999, help="AdamW beta2")
    adam_eps: float = field(1e-8, help="AdamW epsilon")
    grad_clip: float = field(1.0, help="global grad-norm clip (0 = off)")
    checkpoint_dir: str = field("", help="directory for training checkpoints (model, optimizer, RNG, step, version)")
    resume: bool = field(False, help="resume from the latest checkpoint in checkpoint_dir at start-up")
    log_level: str = field("INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level")
    log_format: str = field("text", choices=("text", "json"), help="log format; json gives one structured object per line")

    def validate(self) -> None:
        parse_host_port("grpc_address", self.grpc_address)
        parse_host_port("http_address", self.http_address)
        for a in self.rollouts:
            parse_host_port("rollouts", a)
        for name in ("tp", "pp", "vpp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.vpp > 1 and self.pp < 2:
            raise ConfigError(f"vpp={self.vpp} needs pp >= 2 (virtual stages interleave pipeline ranks)")
        if self.backend == "hf" and self.tp * self.pp * self.vpp * self.ep != 1:
            raise ConfigError("backend=hf runs one process: set tp=pp=vpp=ep=1 or use backend=megatron")
        if self.backend == "hf" and self.mtp != "off":
            raise ConfigError("mtp needs backend=megatron (transformers models have no MTP layers)")
        if self.converter != "builtin":
            if self.backend != "megatron":
                raise ConfigError(f"converter={self.converter} applies to backend=megatron; backend=hf exports "
                                  f"transformers' own tensors (set converter=builtin)")
            missing = missing_package_error(self.converter)
            if missing:
                raise ConfigError(missing)
        if not 1 <= self.bucket_mb <= 16384:
            raise ConfigError(f"bucket_mb={self.bucket_mb} must be in [1, 16384]")
        if self.sync_timeout_s <= 0 or self.rpc_timeout_s <= 0 or self.nccl_init_timeout_s <= 0:
            raise ConfigError("sync_timeout_s, rpc_timeout_s and nccl_init_timeout_s must be > 0")
        if self.device and not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise ConfigError(f"device={self.device!r} must be cpu, cuda or cuda:N")
        if self.device and self.backend == "megatron":
            raise ConfigError("device applies to backend=hf; megatron places each rank on cuda:LOCAL_RANK itself "
                              "(leave device empty)")
        if self.auth_token and self.auth_token_file:
            raise ConfigError("set auth_token or auth_token_file, not both")
