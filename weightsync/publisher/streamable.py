"""Whether a tensor handed to Publisher.sync can be streamed as its declaration says, checked before anything moves.

A bucket is packed by copying each tensor's values into the declared bytes. A tensor of the declared
shape and dtype can still not be one whose values are there to copy: a sparse or other non-strided
layout, a nested tensor, a quantized one, a meta or fake tensor (no storage), a tensor subclass
whose copy means something else. Found mid-sync, such a tensor broke the stream after the version
was spent and the rollouts prepared it; checked here, the sync is refused naming the tensor and the
fix, and no version is spent. Strides need no check: the copy reads any strided view (transposed,
expanded, sliced) value by value.
"""

from __future__ import annotations

import torch

#: subclasses whose values are the tensor's own (a Parameter is a plain tensor with a flag)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def check_streamable(name: str, t: torch.Tensor) -> None:
    """ValueError/TypeError naming `name` when `t` cannot be copied into a bucket as a dense tensor."""
    if type(t) not in _PLAIN:
        raise TypeError(
            f"{name}: a {type(t).__module__}.{type(t).__name__}, not a plain torch.Tensor; give its full "
            "values as one (e.g. DTensor.full_tensor(), or the tensor the subclass wraps)"
        )
    if t.is_nested:
        raise ValueError(f"{name}: a nested tensor; give one dense tensor of the declared shape")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: layout {t.layout}, not torch.strided; give it dense (.to_dense())")
    if t.is_quantized:
        raise ValueError(f"{name}: a quantized tensor ({t.dtype}); give its values (.dequantize(), then cast)")
    if t.is_meta:
        raise ValueError(f"{name}: a meta tensor has no values to send; give the materialized tensor")
