"""Mapping between torch dtypes, the wire enum (weightsync.v1.DType) and human names."""

from __future__ import annotations

import torch

from weightsync.v1 import bus_pb2

_TORCH_TO_WIRE = {
    torch.float32: bus_pb2.FLOAT32,
    torch.bfloat16: bus_pb2.BFLOAT16,
    torch.float16: bus_pb2.FLOAT16,
    torch.float64: bus_pb2.FLOAT64,
    torch.int64: bus_pb2.INT64,
    torch.int32: bus_pb2.INT32,
    torch.int16: bus_pb2.INT16,
    torch.int8: bus_pb2.INT8,
    torch.uint8: bus_pb2.UINT8,
    torch.bool: bus_pb2.BOOL,
    torch.float8_e4m3fn: bus_pb2.FLOAT8_E4M3FN,
    torch.float8_e5m2: bus_pb2.FLOAT8_E5M2,
}
_WIRE_TO_TORCH = {v: k for k, v in _TORCH_TO_WIRE.items()}

_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def to_wire(dtype: torch.dtype) -> int:
    try:
        return _TORCH_TO_WIRE[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot travel on the weight bus; supported: {sorted(str(d) for d in _TORCH_TO_WIRE)}"
        ) from None


def from_wire(wire: int) -> torch.dtype:
    try:
        return _WIRE_TO_TORCH[wire]
    except KeyError:
        raise ValueError(f"unknown wire dtype {wire} (weightsync.v1.DType); peer is newer or corrupt") from None


def parse_dtype(name: str) -> torch.dtype:
    """Parse a config value such as 'bf16' or 'float32'."""
    try:
        return _NAMES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_NAMES)}") from None


def element_size(dtype: torch.dtype) -> int:
    # dtype.itemsize, not a probe tensor: this runs for every tensor of every sync, several times
    return dtype.itemsize
