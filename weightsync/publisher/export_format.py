"""The trainer's `export_dtype` setting: a plain dtype, or block FP8 (`fp8-block`).

A plain dtype is applied by the actor itself as it exports. `fp8-block` asks the actor for its
full-precision tensors (float32) and maps that stream onto the block FP8 one
(weightsync.formats.fp8_export): every linear weight as e4m3 + float32 `weight_scale_inv`, the
rest bf16. The sync and `ExportHf` go through `metas` / `tensors`, so they send and write the
same bytes; an `ExportHf` directory is then a block-FP8 HF checkpoint (its config.json carries
`quantization_config`), the form SGLang needs to serve FP8 and take FP8 syncs unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from weightsync.bus.dtypes import parse_dtype
from weightsync.bus.plan import Quantization, TensorMeta
from weightsync.formats import fp8_export
from weightsync.formats.fp8_spec import BLOCK_FP8, hf_quantization_config

FP8_BLOCK = "fp8-block"


@dataclass(frozen=True)
class ExportFormat:
    name: str
    quantization: Quantization | None = None

    def metas(self, metas: Iterable[TensorMeta]) -> list[TensorMeta]:
        return fp8_export.export_metas(metas) if self.quantization else list(metas)

    def tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return fp8_export.export_tensors(named) if self.quantization else iter(named)

    def owners(self, metas: Iterable[TensorMeta], owners: Iterable[int]) -> list[int]:
        """The owner rank of each exported tensor (`metas(metas)`), from the owner of each plain one:
        a weight's scale travels with it, from the rank that assembles the weight."""
        metas, owners = list(metas), list(owners)
        if len(owners) != len(metas):
            raise ValueError(f"{len(owners)} owners for {len(metas)} tensors")
        if not self.quantization:
            return owners
        out: list[int] = []
        for m, o in zip(metas, owners):
            out += [o] * len(self.metas([m]))  # the format maps each tensor on its own, in order
        return out

    def hf_config(self, config):
        """The config an exported directory declares (with `quantization_config` when quantized)."""
        if self.quantization is None:
            return config
        config = copy.deepcopy(config)
        config.quantization_config = hf_quantization_config(self.quantization)
        return config


#: no format of its own: the tensors as the actor exports them
PLAIN = ExportFormat("as exported by the actor")


def export_format(export_dtype: str) -> ExportFormat:
    return ExportFormat(export_dtype, BLOCK_FP8 if export_dtype == FP8_BLOCK else None)


def actor_dtype(export_dtype: str) -> torch.dtype:
    """The dtype the actor exports in: quantization starts from float32, not from a rounded copy."""
    return torch.float32 if export_dtype == FP8_BLOCK else parse_dtype(export_dtype)
