"""A block-FP8 bucket written straight into the engine's parameters, dequantized, checksummed as it is read.

Both apply strategies use it for a quantized sync whose engine dequantizes (the built-in engine)
and offers its parameters (`writable_params`): inplace at receipt, the bucket's check after the
write as for a bf16 bucket (apply_inplace.py); staged at commit, from this sync's own copy of each
bucket, checked before (apply_staged.py). One launch per bucket (weightsync/formats/fp8/dequantize_slots.py)
replaces the per-weight dequantize, its temporary and the engine's copy. A bucket it cannot take
returns None: the caller loads it through the Dequantizer, with `held_scales` added.
"""

from __future__ import annotations

import torch

from rollout_svc.sync.pending import PendingSync
from weightsync.bus.plan import BucketPlan, TensorMeta
from weightsync.formats.fp8.dequantize_slots import FusedDequant
from weightsync.formats.fp8.spec import FP8_DTYPE, SCALE_DTYPE, SCALE_SUFFIX


def params_for(engine, p: PendingSync, plan: BucketPlan) -> list[torch.Tensor | None] | None:
    """The parameter of each slot (None for a scale), or None when the engine does not offer them
    laid out as the dequantized tensors (each FP8 weight in its parameter's dtype, the rest as sent)."""
    metas, where = [], []
    for i, slot in enumerate(plan.slots):
        m = slot.meta
        if m.dtype == SCALE_DTYPE and m.name.endswith(SCALE_SUFFIX):
            continue  # a scale: its weight is FP8 in this manifest (checked at prepare: receive.logical_metas)
        if m.dtype == FP8_DTYPE:
            m = TensorMeta(m.name, m.shape, p.dequantizer.dtype_of(m.name))
        metas.append(m)
        where.append(i)
    params = engine.writable_params(metas) if metas else []
    if params is None:
        return None
    out: list[torch.Tensor | None] = [None] * len(plan.slots)
    for i, t in zip(where, params):
        out[i] = t
    return out


def write(fused: FusedDequant, engine, p: PendingSync, plan: BucketPlan, buf: torch.Tensor, wait: bool, sums_to=None):
    """Bucket `plan` from `buf` into the engine's parameters: its checksum (a PendingChecksum with
    `wait=False`), or None with nothing written."""
    with p.lock:  # several senders' threads may bring a sync's first buckets at once
        if p.fp8_held is None:
            p.fp8_held = fused.begin(p.manifest)
        held = p.fp8_held
    params = params_for(engine, p, plan)
    if params is None:
        return None
    return fused.copy(plan, buf, params, held, wait=wait, sums_to=sums_to)


def held_scales(fused: FusedDequant, p: PendingSync, plan: BucketPlan) -> list[tuple[str, torch.Tensor]]:
    """The scales this path holds for `plan`'s weights: what a per-tensor load of the bucket adds."""
    return fused.held_for(plan, p.fp8_held) if p.fp8_held else []
