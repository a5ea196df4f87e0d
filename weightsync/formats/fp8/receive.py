"""The receiving side of block FP8: check a manifest's pairs, and dequantize a tensor stream.

An engine that cannot run FP8 weights itself (the built-in engine) receives each `X` already
dequantized (to its parameter's dtype); an engine that loads FP8 natively
(SGLang serving a block-FP8 checkpoint) receives the pairs unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from weightsync.bus.plan import TensorMeta, fast_meta
from weightsync.formats.fp8.blocks import FP8_DTYPE, SCALE_DTYPE, SCALE_SUFFIX, dequantize, scale_shape, weight_name


def logical_metas(metas: Iterable[TensorMeta]) -> list[TensorMeta]:
    """The manifest as the model sees it: each (X_scale_inv, X) pair becomes X in float32.

    Raises ValueError naming the tensor when a pair is incomplete or its shapes disagree.
    """
    metas = list(metas)
    by_name = {m.name: m for m in metas}
    out: list[TensorMeta] = []
    # a MoE model has a handful of distinct shapes over 100,000 tensors: each scale shape computed once
    scale_shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    for m in metas:
        w = weight_name(m.name)
        if w is not None and w in by_name:
            if by_name[w].dtype != FP8_DTYPE:
                raise ValueError(
                    f"manifest tensor {m.name} is a block scale but {w} is {by_name[w].dtype}, not {FP8_DTYPE}"
                )
            continue  # folded into its weight
        if m.dtype == FP8_DTYPE:
            s = by_name.get(m.name + SCALE_SUFFIX)
            if s is None:
                raise ValueError(f"manifest tensor {m.name} is float8_e4m3fn but {m.name}{SCALE_SUFFIX} is missing")
            want = scale_shapes.get(m.shape)
            if want is None:
                want = scale_shapes[m.shape] = scale_shape(m.shape)
            if tuple(s.shape) != want or s.dtype != SCALE_DTYPE:
                raise ValueError(
                    f"manifest tensor {s.name}: shape {list(s.shape)} {s.dtype}, expected {list(want)} "
                    f"{SCALE_DTYPE} for {m.name} of shape {list(m.shape)} (128x128 blocks)"
                )
            out.append(fast_meta(m.name, m.shape, torch.float32, 4 * m.nbytes))  # e4m3: 1 byte per element
        elif w is not None and m.dtype == SCALE_DTYPE:
            raise ValueError(f"manifest tensor {m.name} is a block scale but {w} is not in the manifest")
        else:
            out.append(m)
    return out


class Dequantizer:
    """Joins each scale with its weight across the buckets of one sync and yields X dequantized.

    One per sync: a scale left waiting (a sync that ended early) never meets the next sync's
    weight. Held tensors are copies, since bucket buffers are reused after each bucket.
    `dtypes` maps a weight to the dtype it is produced in (default float32): the product is
    always computed in float32 and rounded once, so this equals casting the float32 result later.
    """

    def __init__(self, dtypes: dict[str, torch.dtype] | None = None):
        self._dtypes = dtypes or {}
        self._scales: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}

    def __call__(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            w = weight_name(name)
            if w is not None and t.dtype == SCALE_DTYPE:
                if w in self._weights:
                    yield w, dequantize(self._weights.pop(w), t, self._dtypes.get(w, torch.float32), name=w)
                else:
                    self._scales[w] = t.clone()
            elif t.dtype == FP8_DTYPE:
                if name in self._scales:
                    yield name, dequantize(t, self._scales.pop(name), self._dtypes.get(name, torch.float32), name=name)
                else:
                    self._weights[name] = t.clone()
            else:
                yield name, t

    def fresh(self) -> "Dequantizer":
        """A new Dequantizer producing the same dtypes, holding nothing: the next sync's."""
        return Dequantizer(self._dtypes)

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype weight `name` is produced in (its parameter's)."""
        return self._dtypes.get(name, torch.float32)

    def check_complete(self) -> None:
        left = sorted(self._scales) + sorted(self._weights)
        if left:
            raise ValueError(f"tensor {left[0]}: its FP8 weight or scale never arrived ({len(left)} unpaired)")
