from weightsync.v1 import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRolloutRequest(_message.Message):
    __slots__ = ("rollout_id", "address", "num_ranks", "model_family", "param_signature")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    PARAM_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    address: str
    num_ranks: int
    model_family: str
    param_signature: int
    def __init__(self, rollout_id: _Optional[str] = ..., address: _Optional[str] = ..., num_ranks: _Optional[int] = ..., model_family: _Optional[str] = ..., param_signature: _Optional[int] = ...) -> None: ...

class RegisterRolloutResponse(_message.Message):
    __slots__ = ("trainer_version", "sync_scheduled", "trainer_id", "current")
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    trainer_version: int
    sync_scheduled: bool
    trainer_id: str
    current: bool
    def __init__(self, trainer_version: _Optional[int] = ..., sync_scheduled: _Optional[bool] = ..., trainer_id: _Optional[str] = ..., current: _Optional[bool] = ...) -> None: ...

class DeregisterRolloutRequest(_message.Message):
    __slots__ = ("rollout_id",)
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    def __init__(self, rollout_id: _Optional[str] = ...) -> None: ...

class DeregisterRolloutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("rollout_ids", "transport", "timeout_seconds", "senders", "allow_rollback", "ipc_direction")
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SENDERS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    IPC_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    transport: str
    timeout_seconds: float
    senders: str
    allow_rollback: bool
    ipc_direction: str
    def __init__(self, rollout_ids: _Optional[_Iterable[str]] = ..., transport: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., senders: _Optional[str] = ..., allow_rollback: _Optional[bool] = ..., ipc_direction: _Optional[str] = ...) -> None: ...

class RolloutSyncResult(_message.Message):
    __slots__ = ("rollout_id", "ok", "version", "error", "seconds", "encoding", "wire_bytes", "bytes_per_rank")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    ok: bool
    version: int
    error: str
    seconds: float
    encoding: str
    wire_bytes: int
    bytes_per_rank: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rollout_id: _Optional[str] = ..., ok: _Optional[bool] = ..., version: _Optional[int] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ..., encoding: _Optional[str] = ..., wire_bytes: _Optional[int] = ..., bytes_per_rank: _Optional[_Iterable[int]] = ...) -> None: ...

class SenderReport(_message.Message):
    __slots__ = ("rank", "bytes", "num_buckets", "seconds", "error", "forwarded_bytes", "peak_buffer_bytes", "flat_buckets")
    RANK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FORWARDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLAT_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    bytes: int
    num_buckets: int
    seconds: float
    error: str
    forwarded_bytes: int
    peak_buffer_bytes: int
    flat_buckets: int
    def __init__(self, rank: _Optional[int] = ..., bytes: _Optional[int] = ..., num_buckets: _Optional[int] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ..., forwarded_bytes: _Optional[int] = ..., peak_buffer_bytes: _Optional[int] = ..., flat_buckets: _Optional[int] = ...) -> None: ...

class SyncReport(_message.Message):
    __slots__ = ("sync_id", "version", "ok", "seconds", "bytes", "num_buckets", "num_tensors", "transport", "rollouts", "gbps", "phase_seconds", "senders", "wire_bytes", "route")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    GBPS_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SENDERS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    sync_id: str
    version: int
    ok: bool
    seconds: float
    bytes: int
    num_buckets: int
    num_tensors: int
    transport: str
    rollouts: _containers.RepeatedCompositeFieldContainer[RolloutSyncResult]
    gbps: float
    phase_seconds: _containers.ScalarMap[str, float]
    senders: _containers.RepeatedCompositeFieldContainer[SenderReport]
    wire_bytes: int
    route: str
    def __init__(self, sync_id: _Optional[str] = ..., version: _Optional[int] = ..., ok: _Optional[bool] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., num_buckets: _Optional[int] = ..., num_tensors: _Optional[int] = ..., transport: _Optional[str] = ..., rollouts: _Optional[_Iterable[_Union[RolloutSyncResult, _Mapping]]] = ..., gbps: _Optional[float] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., senders: _Optional[_Iterable[_Union[SenderReport, _Mapping]]] = ..., wire_bytes: _Optional[int] = ..., route: _Optional[str] = ...) -> None: ...

class SyncResponse(_message.Message):
    __slots__ = ("report",)
    REPORT_FIELD_NUMBER: _ClassVar[int]
    report: SyncReport
    def __init__(self, report: _Optional[_Union[SyncReport, _Mapping]] = ...) -> None: ...

class TrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SyncProgressRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SyncProgress(_message.Message):
    __slots__ = ("in_progress", "sync_id", "version", "phase", "bytes", "bytes_sent", "num_rollouts", "seconds", "transport")
    IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    in_progress: bool
    sync_id: str
    version: int
    phase: str
    bytes: int
    bytes_sent: int
    num_rollouts: int
    seconds: float
    transport: str
    def __init__(self, in_progress: _Optional[bool] = ..., sync_id: _Optional[str] = ..., version: _Optional[int] = ..., phase: _Optional[str] = ..., bytes: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., num_rollouts: _Optional[int] = ..., seconds: _Optional[float] = ..., transport: _Optional[str] = ...) -> None: ...

class RolloutInfo(_message.Message):
    __slots__ = ("rollout_id", "address", "version", "state", "reachable", "last_error", "last_sync_seconds", "origin")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    address: str
    version: int
    state: _rollout_pb2.EngineState
    reachable: bool
    last_error: str
    last_sync_seconds: float
    origin: str
    def __init__(self, rollout_id: _Optional[str] = ..., address: _Optional[str] = ..., version: _Optional[int] = ..., state: _Optional[_Union[_rollout_pb2.EngineState, str]] = ..., reachable: _Optional[bool] = ..., last_error: _Optional[str] = ..., last_sync_seconds: _Optional[float] = ..., origin: _Optional[str] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("version", "model_family", "num_parameters", "backend", "parallelism", "rollouts", "last_sync", "sync_in_progress", "origin", "trainer_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_FIELD_NUMBER: _ClassVar[int]
    SYNC_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    model_family: str
    num_parameters: int
    backend: str
    parallelism: str
    rollouts: _containers.RepeatedCompositeFieldContainer[RolloutInfo]
    last_sync: SyncReport
    sync_in_progress: bool
    origin: str
    trainer_id: str
    def __init__(self, version: _Optional[int] = ..., model_family: _Optional[str] = ..., num_parameters: _Optional[int] = ..., backend: _Optional[str] = ..., parallelism: _Optional[str] = ..., rollouts: _Optional[_Iterable[_Union[RolloutInfo, _Mapping]]] = ..., last_sync: _Optional[_Union[SyncReport, _Mapping]] = ..., sync_in_progress: _Optional[bool] = ..., origin: _Optional[str] = ..., trainer_id: _Optional[str] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("hf_path",)
    HF_PATH_FIELD_NUMBER: _ClassVar[int]
    hf_path: str
    def __init__(self, hf_path: _Optional[str] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("version", "hf_path")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HF_PATH_FIELD_NUMBER: _ClassVar[int]
    version: int
    hf_path: str
    def __init__(self, version: _Optional[int] = ..., hf_path: _Optional[str] = ...) -> None: ...

class ExportHfRequest(_message.Message):
    __slots__ = ("out_dir",)
    OUT_DIR_FIELD_NUMBER: _ClassVar[int]
    out_dir: str
    def __init__(self, out_dir: _Optional[str] = ...) -> None: ...

class ExportHfResponse(_message.Message):
    __slots__ = ("out_dir", "version", "num_tensors")
    OUT_DIR_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    out_dir: str
    version: int
    num_tensors: int
    def __init__(self, out_dir: _Optional[str] = ..., version: _Optional[int] = ..., num_tensors: _Optional[int] = ...) -> None: ...

class TrainSample(_message.Message):
    __slots__ = ("prompt_ids", "response_ids", "rollout_logprobs", "reward", "group_id")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    reward: float
    group_id: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., reward: _Optional[float] = ..., group_id: _Optional[int] = ...) -> None: ...

class LossConfig(_message.Message):
    __slots__ = ("algorithm", "clip_eps_low", "clip_eps_high", "dual_clip_c", "aggregation", "kl_coef", "entropy_coef", "advantages")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CLIP_EPS_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_EPS_HIGH_FIELD_NUMBER: _ClassVar[int]
    DUAL_CLIP_C_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEF_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    algorithm: str
    clip_eps_low: float
    clip_eps_high: float
    dual_clip_c: float
    aggregation: str
    kl_coef: float
    entropy_coef: float
    advantages: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, algorithm: _Optional[str] = ..., clip_eps_low: _Optional[float] = ..., clip_eps_high: _Optional[float] = ..., dual_clip_c: _Optional[float] = ..., aggregation: _Optional[str] = ..., kl_coef: _Optional[float] = ..., entropy_coef: _Optional[float] = ..., advantages: _Optional[_Iterable[float]] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("samples", "loss", "micro_batch_size")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[TrainSample]
    loss: LossConfig
    micro_batch_size: int
    def __init__(self, samples: _Optional[_Iterable[_Union[TrainSample, _Mapping]]] = ..., loss: _Optional[_Union[LossConfig, _Mapping]] = ..., micro_batch_size: _Optional[int] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("version", "step", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class LogprobRow(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("samples", "reference")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[TrainSample]
    reference: bool
    def __init__(self, samples: _Optional[_Iterable[_Union[TrainSample, _Mapping]]] = ..., reference: _Optional[bool] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("rows", "version")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[LogprobRow]
    version: int
    def __init__(self, rows: _Optional[_Iterable[_Union[LogprobRow, _Mapping]]] = ..., version: _Optional[int] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("dir", "format")
    DIR_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    dir: str
    format: str
    def __init__(self, dir: _Optional[str] = ..., format: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("dir", "step", "version")
    DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    dir: str
    step: int
    version: int
    def __init__(self, dir: _Optional[str] = ..., step: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...
