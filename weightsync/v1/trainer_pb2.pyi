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
    __slots__ = ("trainer_version", "sync_scheduled")
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    trainer_version: int
    sync_scheduled: bool
    def __init__(self, trainer_version: _Optional[int] = ..., sync_scheduled: _Optional[bool] = ...) -> None: ...

class DeregisterRolloutRequest(_message.Message):
    __slots__ = ("rollout_id",)
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    def __init__(self, rollout_id: _Optional[str] = ...) -> None: ...

class DeregisterRolloutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("rollout_ids", "transport", "timeout_seconds")
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    transport: str
    timeout_seconds: float
    def __init__(self, rollout_ids: _Optional[_Iterable[str]] = ..., transport: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class RolloutSyncResult(_message.Message):
    __slots__ = ("rollout_id", "ok", "version", "error", "seconds")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    ok: bool
    version: int
    error: str
    seconds: float
    def __init__(self, rollout_id: _Optional[str] = ..., ok: _Optional[bool] = ..., version: _Optional[int] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class SyncReport(_message.Message):
    __slots__ = ("sync_id", "version", "ok", "seconds", "bytes", "num_buckets", "num_tensors", "transport", "rollouts", "gbps")
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
    def __init__(self, sync_id: _Optional[str] = ..., version: _Optional[int] = ..., ok: _Optional[bool] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., num_buckets: _Optional[int] = ..., num_tensors: _Optional[int] = ..., transport: _Optional[str] = ..., rollouts: _Optional[_Iterable[_Union[RolloutSyncResult, _Mapping]]] = ..., gbps: _Optional[float] = ...) -> None: ...

class SyncResponse(_message.Message):
    __slots__ = ("report",)
    REPORT_FIELD_NUMBER: _ClassVar[int]
    report: SyncReport
    def __init__(self, report: _Optional[_Union[SyncReport, _Mapping]] = ...) -> None: ...

class TrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutInfo(_message.Message):
    __slots__ = ("rollout_id", "address", "version", "state", "reachable", "last_error", "last_sync_seconds")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    address: str
    version: int
    state: _rollout_pb2.EngineState
    reachable: bool
    last_error: str
    last_sync_seconds: float
    def __init__(self, rollout_id: _Optional[str] = ..., address: _Optional[str] = ..., version: _Optional[int] = ..., state: _Optional[_Union[_rollout_pb2.EngineState, str]] = ..., reachable: _Optional[bool] = ..., last_error: _Optional[str] = ..., last_sync_seconds: _Optional[float] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("version", "model_family", "num_parameters", "backend", "parallelism", "rollouts", "last_sync", "sync_in_progress")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_FIELD_NUMBER: _ClassVar[int]
    SYNC_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    version: int
    model_family: str
    num_parameters: int
    backend: str
    parallelism: str
    rollouts: _containers.RepeatedCompositeFieldContainer[RolloutInfo]
    last_sync: SyncReport
    sync_in_progress: bool
    def __init__(self, version: _Optional[int] = ..., model_family: _Optional[str] = ..., num_parameters: _Optional[int] = ..., backend: _Optional[str] = ..., parallelism: _Optional[str] = ..., rollouts: _Optional[_Iterable[_Union[RolloutInfo, _Mapping]]] = ..., last_sync: _Optional[_Union[SyncReport, _Mapping]] = ..., sync_in_progress: _Optional[bool] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("hf_path",)
    HF_PATH_FIELD_NUMBER: _ClassVar[int]
    hf_path: str
    def __init__(self, hf_path: _Optional[str] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

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
