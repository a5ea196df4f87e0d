"""The trainer's `export_dtype` setting: a plain dtype, or block FP8 (`fp8-block`).

A plain dtype is applied by the actor itself as it exports. `fp8-block` asks the actor for its
full-precision tensors (float32) and maps that stream onto the block FP8 one
(weightsync.formats.fp8.export): every linear weight as e4m3 + float32 `weight_scale_inv`, the
rest bf16. The sync and `ExportHf` go through `metas` / `tensors`, so they send and write the
same bytes; an `ExportHf` directory is then a block-FP8 HF checkpoint (its config.json carries
`quantization_config`), the form SGLang needs to serve FP8 and take FP8 syncs unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from weightsync.bus.dtypes import parse_dtype
from weightsync.bus.plan import Quantization, TensorMeta, bulk
from weightsync.formats.fp8 import export as fp8_export
from weightsync.formats.fp8.spec import BLOCK_FP8, hf_quantization_config

FP8_BLOCK = "fp8-block"


@dataclass(frozen=True)
class ExportFormat:
    name: str
    quantization: Quantization | None = None
    #: the last `metas` / `owners` mapping, by its inputs: a sync plans with the actor's same metas
    #: every time, and mapping them afresh (a regex per tensor, twice) cost measurable time in each FP8
    #: sync's plan phase, and its new list made the manifest cache compare every entry
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def metas(self, metas: Iterable[TensorMeta]) -> list[TensorMeta]:
        """The exported tensors' metas (a quantized format: the same list object for the same
        input, which callers must not change)."""
        if not self.quantization:
            return list(metas)
        hit = self._memo.get("metas")
        if hit is not None and (metas is hit[2] or _same(hit[0], metas)):
            return hit[1]
        given = metas
        metas = list(metas)
        with bulk():
            out = fp8_export.export_metas(metas)
        # the caller's own list too: an actor that hands back the same list each sync costs one identity check
        self._memo["metas"] = (metas, out, given)
        return out

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
        hit = self._memo.get("owners")
        if hit is not None and hit[1] == owners and _same(hit[0], metas):
            return list(hit[2])
        out: list[int] = []
        for m, o in zip(metas, owners):
            out += [o] * (2 if fp8_export.is_quantized(m.name, m.shape) else 1)  # a quantized weight: scale + weight
        self._memo["owners"] = (metas, owners, out)
        return list(out)

    def hf_config(self, config):
        """The config an exported directory declares (with `quantization_config` when quantized)."""
        if self.quantization is None:
            return config
        config = copy.deepcopy(config)
        config.quantization_config = hf_quantization_config(self.quantization)
        return config


def _same(a: list[TensorMeta], b: list[TensorMeta]) -> bool:
    """Whether two meta lists are equal: list equality tries each pair's identity first, in C, so a copy
    of the actor's own list (the same objects) costs well under a millisecond at 140,000 tensors, where a
    Python loop over the pairs cost 50 ms of every sync's plan."""
    return a == b


#: no format of its own: the tensors as the actor exports them
PLAIN = ExportFormat("as exported by the actor")


def export_format(export_dtype: str) -> ExportFormat:
    return ExportFormat(export_dtype, BLOCK_FP8 if export_dtype == FP8_BLOCK else None)


def actor_dtype(export_dtype: str) -> torch.dtype:
    """The dtype the actor exports in: quantization starts from float32, not from a rounded copy."""
    return torch.float32 if export_dtype == FP8_BLOCK else parse_dtype(export_dtype)
