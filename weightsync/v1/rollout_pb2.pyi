from weightsync.v1 import bus_pb2 as _bus_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    LOADING: _ClassVar[EngineState]
    SERVING: _ClassVar[EngineState]
    SYNCING: _ClassVar[EngineState]
    APPLYING: _ClassVar[EngineState]
    STALE: _ClassVar[EngineState]
ENGINE_STATE_UNSPECIFIED: EngineState
LOADING: EngineState
SERVING: EngineState
SYNCING: EngineState
APPLYING: EngineState
STALE: EngineState

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("rollout_id", "state", "version", "weights_checksum", "engine", "model_family", "num_parameters", "num_ranks", "pending_sync_id", "last_error", "last_apply_seconds", "prefix_cache_entries", "origin", "trainer_id", "current", "manifest_runs", "memory_released")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_RUNS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RELEASED_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    state: EngineState
    version: int
    weights_checksum: int
    engine: str
    model_family: str
    num_parameters: int
    num_ranks: int
    pending_sync_id: str
    last_error: str
    last_apply_seconds: float
    prefix_cache_entries: int
    origin: str
    trainer_id: str
    current: bool
    manifest_runs: bool
    memory_released: bool
    def __init__(self, rollout_id: _Optional[str] = ..., state: _Optional[_Union[EngineState, str]] = ..., version: _Optional[int] = ..., weights_checksum: _Optional[int] = ..., engine: _Optional[str] = ..., model_family: _Optional[str] = ..., num_parameters: _Optional[int] = ..., num_ranks: _Optional[int] = ..., pending_sync_id: _Optional[str] = ..., last_error: _Optional[str] = ..., last_apply_seconds: _Optional[float] = ..., prefix_cache_entries: _Optional[int] = ..., origin: _Optional[str] = ..., trainer_id: _Optional[str] = ..., current: _Optional[bool] = ..., manifest_runs: _Optional[bool] = ..., memory_released: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "n")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "return_logprobs")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    return_logprobs: bool
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., return_logprobs: _Optional[bool] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt_index", "token_ids", "logprobs", "finish_reason", "prefix_cache_hit")
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    prompt_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    prefix_cache_hit: bool
    def __init__(self, prompt_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., prefix_cache_hit: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("samples", "version")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    version: int
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., version: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("token_ids", "prompt_length", "return_last_logits")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RETURN_LAST_LOGITS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    return_last_logits: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ..., return_last_logits: _Optional[bool] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("logprobs", "last_logits_f32", "version")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LAST_LOGITS_F32_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    last_logits_f32: bytes
    version: int
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., last_logits_f32: _Optional[bytes] = ..., version: _Optional[int] = ...) -> None: ...

class PrepareSyncRequest(_message.Message):
    __slots__ = ("manifest", "transport", "timeout_seconds", "trainer_id", "allow_rollback", "delta_base", "traceparent")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOW_ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    manifest: _bus_pb2.Manifest
    transport: _bus_pb2.TransportSpec
    timeout_seconds: float
    trainer_id: str
    allow_rollback: bool
    delta_base: DeltaBase
    traceparent: str
    def __init__(self, manifest: _Optional[_Union[_bus_pb2.Manifest, _Mapping]] = ..., transport: _Optional[_Union[_bus_pb2.TransportSpec, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., trainer_id: _Optional[str] = ..., allow_rollback: _Optional[bool] = ..., delta_base: _Optional[_Union[DeltaBase, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class DeltaBase(_message.Message):
    __slots__ = ("version", "origin", "layout_digest", "sync_ids")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SYNC_IDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    origin: str
    layout_digest: str
    sync_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., origin: _Optional[str] = ..., layout_digest: _Optional[str] = ..., sync_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PrepareSyncResponse(_message.Message):
    __slots__ = ("transport", "num_ranks", "manifest_needed", "commit_on_stream", "sync_link", "delta_accepted", "delta_refusal", "manifest_runs")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_NEEDED_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ON_STREAM_FIELD_NUMBER: _ClassVar[int]
    SYNC_LINK_FIELD_NUMBER: _ClassVar[int]
    DELTA_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_RUNS_FIELD_NUMBER: _ClassVar[int]
    transport: _bus_pb2.TransportSpec
    num_ranks: int
    manifest_needed: bool
    commit_on_stream: bool
    sync_link: str
    delta_accepted: bool
    delta_refusal: str
    manifest_runs: bool
    def __init__(self, transport: _Optional[_Union[_bus_pb2.TransportSpec, _Mapping]] = ..., num_ranks: _Optional[int] = ..., manifest_needed: _Optional[bool] = ..., commit_on_stream: _Optional[bool] = ..., sync_link: _Optional[str] = ..., delta_accepted: _Optional[bool] = ..., delta_refusal: _Optional[str] = ..., manifest_runs: _Optional[bool] = ...) -> None: ...

class PushBucketRequest(_message.Message):
    __slots__ = ("sync_id", "index", "ipc", "checksum", "held_until_commit", "commit")
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    HELD_UNTIL_COMMIT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    sync_id: str
    index: int
    ipc: _bus_pb2.CudaIpcHandle
    checksum: int
    held_until_commit: bool
    commit: CommitSyncRequest
    def __init__(self, sync_id: _Optional[str] = ..., index: _Optional[int] = ..., ipc: _Optional[_Union[_bus_pb2.CudaIpcHandle, _Mapping]] = ..., checksum: _Optional[int] = ..., held_until_commit: _Optional[bool] = ..., commit: _Optional[_Union[CommitSyncRequest, _Mapping]] = ...) -> None: ...

class PushBucketResponse(_message.Message):
    __slots__ = ("index", "commit")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    index: int
    commit: CommitSyncResponse
    def __init__(self, index: _Optional[int] = ..., commit: _Optional[_Union[CommitSyncResponse, _Mapping]] = ...) -> None: ...

class CommitSyncRequest(_message.Message):
    __slots__ = ("sync_id", "version", "checksums", "trainer_id", "traceparent")
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    sync_id: str
    version: int
    checksums: _containers.RepeatedCompositeFieldContainer[_bus_pb2.BucketChecksum]
    trainer_id: str
    traceparent: str
    def __init__(self, sync_id: _Optional[str] = ..., version: _Optional[int] = ..., checksums: _Optional[_Iterable[_Union[_bus_pb2.BucketChecksum, _Mapping]]] = ..., trainer_id: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class CommitSyncResponse(_message.Message):
    __slots__ = ("version", "weights_checksum", "apply_seconds", "bytes_per_rank")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    version: int
    weights_checksum: int
    apply_seconds: float
    bytes_per_rank: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., weights_checksum: _Optional[int] = ..., apply_seconds: _Optional[float] = ..., bytes_per_rank: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseMemoryRequest(_message.Message):
    __slots__ = ("timeout_seconds",)
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    def __init__(self, timeout_seconds: _Optional[float] = ...) -> None: ...

class ReleaseMemoryResponse(_message.Message):
    __slots__ = ("state", "version", "seconds", "released")
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    state: EngineState
    version: int
    seconds: float
    released: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, state: _Optional[_Union[EngineState, str]] = ..., version: _Optional[int] = ..., seconds: _Optional[float] = ..., released: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortSyncRequest(_message.Message):
    __slots__ = ("sync_id", "reason", "trainer_id")
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    sync_id: str
    reason: str
    trainer_id: str
    def __init__(self, sync_id: _Optional[str] = ..., reason: _Optional[str] = ..., trainer_id: _Optional[str] = ...) -> None: ...

class AbortSyncResponse(_message.Message):
    __slots__ = ("state", "version", "aborted_reason")
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REASON_FIELD_NUMBER: _ClassVar[int]
    state: EngineState
    version: int
    aborted_reason: str
    def __init__(self, state: _Optional[_Union[EngineState, str]] = ..., version: _Optional[int] = ..., aborted_reason: _Optional[str] = ...) -> None: ...
