from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]
    FLOAT8_E4M3FN: _ClassVar[DType]
    FLOAT8_E5M2: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
FLOAT64: DType
INT64: DType
INT32: DType
INT16: DType
INT8: DType
UINT8: DType
BOOL: DType
FLOAT8_E4M3FN: DType
FLOAT8_E5M2: DType

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes", "run_count", "run_first", "run_stride", "run_members")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    RUN_COUNT_FIELD_NUMBER: _ClassVar[int]
    RUN_FIRST_FIELD_NUMBER: _ClassVar[int]
    RUN_STRIDE_FIELD_NUMBER: _ClassVar[int]
    RUN_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    run_count: int
    run_first: int
    run_stride: int
    run_members: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., run_count: _Optional[int] = ..., run_first: _Optional[int] = ..., run_stride: _Optional[int] = ..., run_members: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ...) -> None: ...

class BucketSpec(_message.Message):
    __slots__ = ("index", "nbytes", "tensors", "sender", "num_tensors")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    index: int
    nbytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    sender: int
    num_tensors: int
    def __init__(self, index: _Optional[int] = ..., nbytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., sender: _Optional[int] = ..., num_tensors: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("version", "sync_id", "bucket_bytes", "buckets", "total_bytes", "model_family", "checksum_algo", "origin", "quantization", "layout_digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    sync_id: str
    bucket_bytes: int
    buckets: _containers.RepeatedCompositeFieldContainer[BucketSpec]
    total_bytes: int
    model_family: str
    checksum_algo: str
    origin: str
    quantization: Quantization
    layout_digest: str
    def __init__(self, version: _Optional[int] = ..., sync_id: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., buckets: _Optional[_Iterable[_Union[BucketSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., model_family: _Optional[str] = ..., checksum_algo: _Optional[str] = ..., origin: _Optional[str] = ..., quantization: _Optional[_Union[Quantization, _Mapping]] = ..., layout_digest: _Optional[str] = ...) -> None: ...

class Quantization(_message.Message):
    __slots__ = ("method", "fmt", "weight_block_size")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    FMT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    method: str
    fmt: str
    weight_block_size: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, method: _Optional[str] = ..., fmt: _Optional[str] = ..., weight_block_size: _Optional[_Iterable[int]] = ...) -> None: ...

class BucketChecksum(_message.Message):
    __slots__ = ("index", "checksum")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    index: int
    checksum: int
    def __init__(self, index: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class TcpTransport(_message.Message):
    __slots__ = ("data_address",)
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    data_address: str
    def __init__(self, data_address: _Optional[str] = ...) -> None: ...

class NcclTransport(_message.Message):
    __slots__ = ("unique_id", "world_size", "rank_offset", "group_id", "timeout_seconds", "new_group", "device_uuid", "sender_groups")
    UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEW_GROUP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    SENDER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    unique_id: bytes
    world_size: int
    rank_offset: int
    group_id: str
    timeout_seconds: float
    new_group: bool
    device_uuid: str
    sender_groups: _containers.RepeatedCompositeFieldContainer[NcclSenderGroup]
    def __init__(self, unique_id: _Optional[bytes] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., group_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., new_group: _Optional[bool] = ..., device_uuid: _Optional[str] = ..., sender_groups: _Optional[_Iterable[_Union[NcclSenderGroup, _Mapping]]] = ...) -> None: ...

class NcclSenderGroup(_message.Message):
    __slots__ = ("sender", "unique_id", "group_id", "new_group")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_GROUP_FIELD_NUMBER: _ClassVar[int]
    sender: int
    unique_id: bytes
    group_id: str
    new_group: bool
    def __init__(self, sender: _Optional[int] = ..., unique_id: _Optional[bytes] = ..., group_id: _Optional[str] = ..., new_group: _Optional[bool] = ...) -> None: ...

class IpcTransport(_message.Message):
    __slots__ = ("host_id", "device_uuid", "trainer_writes", "dest_layout", "destinations", "writes_dequantized")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_WRITES_FIELD_NUMBER: _ClassVar[int]
    DEST_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    WRITES_DEQUANTIZED_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    device_uuid: str
    trainer_writes: bool
    dest_layout: str
    destinations: IpcDestinations
    writes_dequantized: bool
    def __init__(self, host_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., trainer_writes: _Optional[bool] = ..., dest_layout: _Optional[str] = ..., destinations: _Optional[_Union[IpcDestinations, _Mapping]] = ..., writes_dequantized: _Optional[bool] = ...) -> None: ...

class IpcDestinations(_message.Message):
    __slots__ = ("allocations", "tensors")
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    allocations: _containers.RepeatedCompositeFieldContainer[CudaIpcHandle]
    tensors: _containers.RepeatedCompositeFieldContainer[IpcDestTensor]
    def __init__(self, allocations: _Optional[_Iterable[_Union[CudaIpcHandle, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[IpcDestTensor, _Mapping]]] = ...) -> None: ...

class IpcDestTensor(_message.Message):
    __slots__ = ("name", "allocation", "offset", "nbytes", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    allocation: int
    offset: int
    nbytes: int
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., allocation: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TransportSpec(_message.Message):
    __slots__ = ("tcp", "nccl", "ipc")
    TCP_FIELD_NUMBER: _ClassVar[int]
    NCCL_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    tcp: TcpTransport
    nccl: NcclTransport
    ipc: IpcTransport
    def __init__(self, tcp: _Optional[_Union[TcpTransport, _Mapping]] = ..., nccl: _Optional[_Union[NcclTransport, _Mapping]] = ..., ipc: _Optional[_Union[IpcTransport, _Mapping]] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "device_uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., device_uuid: _Optional[str] = ...) -> None: ...
