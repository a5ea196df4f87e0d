"""trainer-svc settings (flags > env WS_TRAINER_* > --config file > defaults), in sections.

Each knob keeps its flat name (flag `--bucket-mb`, env `WS_TRAINER_BUCKET_MB`, file key
`bucket_mb` or `bus: {bucket_mb: ...}`); code reaches it through its section (`cfg.bus.bucket_mb`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainer_svc.bridge_contract import CONTRACTS, missing_package_error
from weightsync.bus.transports import NAMES as TRANSPORTS
from weightsync.bus.transports import choices, multi_sender_names, single_sender_names, summary
from weightsync.config import ConfigError, ServiceConfig, field, parse_host_port, require_positive, section
from weightsync.config_common import AuthConfig, DebugConfig, LogConfig, ServerConfig
from weightsync.sync_options import DEFAULTS as SYNC
from weightsync.sync_options import ENCODINGS, IPC_DIRECTIONS, MIB, SENDERS, SyncOptions

ENV_PREFIX = "WS_TRAINER"


@dataclass
class ActorConfig:
    """Which model the trainer holds and how it exports it."""

    backend: str = field(
        "megatron",
        choices=("megatron", "hf"),
        help="model backend: megatron (megatron-core GPTModel) or hf (transformers, one process)",
    )
    model: str = field(
        "tiny-qwen2", help="HF model directory, or a built-in tiny config name (tiny-qwen2, tiny-llama, tiny-qwen3)"
    )
    init_seed: int = field(1234, help="seed for random initialisation when --model is a config without weights")
    mtp: str = field(
        "off",
        choices=("off", "deepseek", "mimo"),
        help="carry the model's multi-token-prediction layers (num_nextn_predict_layers in its config) and "
        "publish them under DeepSeek-V3 (model.layers.N+i.*) or MiMo (model.mtp_layers.i.*) names",
    )
    export_dtype: str = field(
        "float32",
        choices=("float32", "bfloat16", "float16", "fp8-block"),
        help="dtype tensors are cast to on the bus (match the rollout engine's dtype); "
        "fp8-block: linear weights as e4m3 with 128x128 float32 scales, the rest bf16 "
        "(docs/conversion.md, FP8 export)",
    )
    param_dtype: str = field(
        "float32",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the trainer's parameters (backend hf: the model's; megatron: params_dtype). "
        "Equal to export_dtype on a GPU, backend hf sends its parameters' own memory on the "
        "bus, with no pack copy",
    )
    converter: str = field(
        "builtin",
        choices=("builtin", *CONTRACTS),
        help="backend=megatron: what maps Megatron <-> HF tensors for export and load: builtin "
        "(the rule tables) or a bridge package when installed (mbridge, megatron-bridge; "
        "dense qwen2/llama/qwen3; docs/conversion.md)",
    )
    device: str = field(
        "",
        help="torch device of backend hf's model and export (cpu, cuda, cuda:N; empty = cpu); "
        "backend megatron always uses cuda:LOCAL_RANK when CUDA is available. "
        "Transports nccl and ipc need a CUDA device",
    )

    def validate(self) -> None:
        if self.backend == "hf" and self.mtp != "off":
            raise ConfigError("mtp needs backend=megatron (transformers models have no MTP layers)")
        if self.converter != "builtin":
            if self.backend != "megatron":
                raise ConfigError(
                    f"converter={self.converter} applies to backend=megatron; backend=hf exports "
                    f"transformers' own tensors (set converter=builtin)"
                )
            missing = missing_package_error(self.converter)
            if missing:
                raise ConfigError(missing)
        if self.device and not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise ConfigError(f"device={self.device!r} must be cpu, cuda or cuda:N")
        if self.device and self.backend == "megatron":
            raise ConfigError(
                "device applies to backend=hf; megatron places each rank on cuda:LOCAL_RANK itself (leave device empty)"
            )


@dataclass
class ParallelConfig:
    """Megatron parallel layout (the torchrun world size is its product)."""

    tp: int = field(1, help="tensor-parallel size (must equal the torchrun world size / PP / VPP product)")
    pp: int = field(1, help="pipeline-parallel size")
    vpp: int = field(1, help="virtual pipeline stages per PP rank")
    ep: int = field(
        1,
        help="expert-parallel size for MoE models (experts split over ep ranks; world size must be a multiple "
        "of ep*pp)",
    )

    def validate(self) -> None:
        require_positive(self, ("tp", "pp", "vpp", "ep"))
        if self.vpp > 1 and self.pp < 2:
            raise ConfigError(f"vpp={self.vpp} needs pp >= 2 (virtual stages interleave pipeline ranks)")


@dataclass
class BusConfig:
    """The weight bus as the trainer drives it: transport, buckets, timeouts of a sync."""

    transport: str = field(SYNC.transport, choices=TRANSPORTS, help=f"default weight-bus transport: {summary()}")
    nccl_init_timeout_s: float = field(
        SYNC.nccl_init_timeout_s,
        help="bound on building an NCCL group (every rollout must join within it, and within the sync timeout)",
    )
    bucket_mb: int = field(
        SYNC.bucket_bytes // MIB,
        help="flat bucket size in MiB (1024 measured best on NVLink, docs/BENCHMARKS.md); two buckets are the "
        "sender's extra memory",
    )
    sync_timeout_s: float = field(
        SYNC.sync_timeout_s, help="a sync that has not committed on a rollout within this is aborted there"
    )
    rpc_timeout_s: float = field(SYNC.rpc_timeout_s, help="timeout of each control-plane RPC to a rollout")
    liveness_timeout_s: float = field(
        SYNC.liveness_timeout_s,
        help="a rollout that sends neither an answer nor a liveness beat on its sync link for this long is "
        "gone (stopped, hung, unreachable): its part of the sync fails at once instead of after rpc_timeout_s, "
        "the others commit, and it is caught up when it registers again",
    )
    sync_link: bool = field(
        SYNC.sync_link,
        help="send PrepareSync, CommitSync and AbortSync over the sync link a rollout "
        "offers on its data port (one authenticated connection kept across syncs; "
        "a fraction of a gRPC call's round trip); false: gRPC only",
    )
    senders: str = field(
        SYNC.senders,
        choices=SENDERS,
        help="who streams the buckets: all = every rank that assembles tensors (each pipeline "
        "stage's and expert-parallel leader) streams its own, concurrently, over "
        f"{choices(multi_sender_names())} ({choices(single_sender_names())} carries one sender, "
        "so its syncs funnel); "
        "rank0 = every tensor is sent to global rank 0, the only sender (the funnel)",
    )
    sync_encoding: str = field(
        SYNC.sync_encoding,
        choices=ENCODINGS,
        help="full: every bucket dense; delta: to a rollout on the last committed version, only the "
        "changed 16-bit words (8-bit for fp8) of each bucket, over tcp or nccl, each sender rank diffing "
        "its own buckets (a rollout that lacks the base is sent in full; over nccl every target then is); "
        "auto: delta where the link is the bottleneck: tcp, and nccl once a full sync measured the link "
        "below delta_link_gbps; full otherwise (ipc; nccl over NVLink)",
    )
    ipc_direction: str = field(
        SYNC.ipc_direction,
        choices=IPC_DIRECTIONS,
        help="transport ipc: who moves the bytes. trainer_writes = the trainer writes each bucket straight "
        "into the engine's parameters and checksums it in the same pass (one process touches the bytes; "
        "the rollout's independent second read is gone: docs/architecture.md, 'Trainer writes'); "
        "rollout_reads = the rollout copies out of the trainer's shared buffers and checksums what it read; "
        "auto = trainer_writes where the one target offers it (inplace apply mode, builtin engine; "
        "export_dtype fp8-block too: the trainer writes the weights dequantized), else rollout_reads",
    )
    delta_base_mb: int = field(
        SYNC.delta_base_bytes // MIB,
        help="bound on the trainer's copy of the last committed export kept for delta syncs (host "
        "memory over tcp, the export's GPU over nccl: one copy of the model's export bytes); a larger "
        "model is synced in full; 0: no copy, "
        "no delta",
    )
    delta_link_gbps: float = field(
        SYNC.delta_link_gbps,
        help="sync_encoding=auto over nccl: send deltas when the NCCL link's rate, measured by each full "
        "nccl sync (bytes on the bus / seconds the stream waited on it), is below this many Gb/s. A delta "
        "costs a GPU compare and apply per byte of export and cuts the bytes on the bus many times over: "
        "it wins below a break-even rate (docs/BENCHMARKS.md); 400 (50 GB/s) is below the break-even "
        "measured on H100 and H200 and above inter-host links (100-400 Gb/s IB/RoCE), under NVLink; "
        "0: auto stays full on nccl",
    )

    def validate(self) -> None:
        if not 1 <= self.bucket_mb <= 16384:
            raise ConfigError(f"bucket_mb={self.bucket_mb} must be in [1, 16384]")
        if self.sync_timeout_s <= 0 or self.rpc_timeout_s <= 0 or self.nccl_init_timeout_s <= 0:
            raise ConfigError("sync_timeout_s, rpc_timeout_s and nccl_init_timeout_s must be > 0")
        if self.delta_base_mb < 0:
            raise ConfigError(f"delta_base_mb={self.delta_base_mb} must be >= 0 (0: no delta syncs)")
        if not self.delta_link_gbps >= 0:  # NaN too
            raise ConfigError(
                f"delta_link_gbps={self.delta_link_gbps} must be >= 0 (Gb/s below which auto sends deltas over "
                "nccl; 0: auto stays full on nccl)"
            )
        if self.sync_encoding == "delta" and self.transport not in ("tcp", "nccl"):
            raise ConfigError(
                f"sync_encoding=delta is carried by transports tcp and nccl only (transport={self.transport}): "
                "use sync_encoding=auto, which picks full for ipc"
            )
        if not 1.0 <= self.liveness_timeout_s <= 3600:
            # the rollout beats every 0.25 s: a shorter timeout would fail a busy but healthy rollout
            raise ConfigError(f"liveness_timeout_s={self.liveness_timeout_s} must be in [1, 3600] (seconds)")

    def sync_options(self, export_dtype: str = "", device: str = "cpu") -> SyncOptions:
        """This section as the publisher takes it (bytes and seconds), with the actor's export dtype
        and device: built once at start-up, passed whole to PublisherHost.publish."""
        return SyncOptions(
            transport=self.transport,
            bucket_bytes=self.bucket_mb * MIB,
            sync_timeout_s=self.sync_timeout_s,
            rpc_timeout_s=self.rpc_timeout_s,
            nccl_init_timeout_s=self.nccl_init_timeout_s,
            liveness_timeout_s=self.liveness_timeout_s,
            sync_link=self.sync_link,
            senders=self.senders,
            sync_encoding=self.sync_encoding,
            delta_base_bytes=self.delta_base_mb * MIB,
            delta_link_gbps=self.delta_link_gbps,
            ipc_direction=self.ipc_direction,
            export_dtype=export_dtype,
            device=device,
        )


@dataclass
class FleetConfig:
    """The rollouts this trainer publishes to."""

    rollouts: list[str] = field(
        default_factory=list,
        help="static rollout addresses host:port (comma-separated); rollouts may also register themselves",
    )
    auto_sync_new_rollouts: bool = field(
        True, help="bring a newly registered rollout to the current version automatically"
    )
    trainer_id: str = field(
        "",
        help="this trainer's identity, sent with every sync; rollouts follow one trainer id. "
        "Empty: a random id per start (a restarted trainer is followed by rollouts that "
        "register with it). Set the same value on restarts to keep rollouts that do not",
    )

    def validate(self) -> None:
        for a in self.rollouts:
            parse_host_port("rollouts", a)


@dataclass
class OptimConfig:
    """The optimizer of TrainStep (AdamW) and its schedule."""

    lr: float = field(1e-6, help="optimizer learning rate (AdamW)")
    lr_warmup_steps: int = field(0, help="linear LR warm-up steps, then constant")
    weight_decay: float = field(0.0, help="AdamW weight decay")
    adam_beta1: float = field(0.9, help="AdamW beta1")
    adam_beta2: float = field(0.999, help="AdamW beta2")
    adam_eps: float = field(1e-8, help="AdamW epsilon")
    grad_clip: float = field(1.0, help="global grad-norm clip (0 = off)")

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr} must be > 0")
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"lr_warmup_steps={self.lr_warmup_steps} must be >= 0")
        if self.grad_clip < 0:
            raise ConfigError(f"grad_clip={self.grad_clip} must be >= 0 (0 = off)")

    def lr_at(self, step: int) -> float:
        """LR for the optimizer step that follows `step` completed steps: linear warmup, then constant."""
        if self.lr_warmup_steps and step < self.lr_warmup_steps:
            return self.lr * (step + 1) / self.lr_warmup_steps
        return self.lr


@dataclass
class CheckpointConfig:
    """Training checkpoints."""

    checkpoint_dir: str = field("", help="directory for training checkpoints (model, optimizer, RNG, step, version)")
    resume: bool = field(False, help="resume from the latest checkpoint in checkpoint_dir at start-up")
    load_megatron_checkpoint: str = field(
        "",
        help="backend=megatron: start from this Megatron distributed checkpoint "
        "(torch_dist, written at any TP/PP layout; a Megatron-LM save dir "
        "or one iter_N dir) instead of --model's weights; --model still "
        "gives the architecture (docs/conversion.md)",
    )
    data_root: str = field(
        "",
        help="admin file operations (ExportHf, SaveCheckpoint, LoadWeights: wsctl export/load) "
        "only read and write under this directory (or checkpoint_dir); relative paths are "
        "taken from it. Empty: the working directory at start",
    )

    def validate(self) -> None:
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume=true needs checkpoint_dir")


@dataclass
class TrainerConfig(ServiceConfig):
    server: ServerConfig = section(ServerConfig)
    actor: ActorConfig = section(ActorConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    bus: BusConfig = section(BusConfig)
    fleet: FleetConfig = section(FleetConfig)
    optim: OptimConfig = section(OptimConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    auth: AuthConfig = section(AuthConfig)
    log: LogConfig = section(LogConfig)
    debug: DebugConfig = section(DebugConfig)

    def validate(self) -> None:
        super().validate()
        par = self.parallel
        if self.actor.backend == "hf" and par.tp * par.pp * par.vpp * par.ep != 1:
            raise ConfigError("backend=hf runs one process: set tp=pp=vpp=ep=1 or use backend=megatron")
        if self.checkpoint.load_megatron_checkpoint and self.actor.backend != "megatron":
            raise ConfigError(
                "load_megatron_checkpoint needs backend=megatron (it fills a Megatron model); with "
                "backend=hf start from an HF directory in --model"
            )
