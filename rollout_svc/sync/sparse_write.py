"""Write a delta bucket into the engine as its changed words alone.

A delta sync changes a few percent of a bucket's words (weightsync/bus/delta/codec.py); when the engine's
parameters hold exactly the rollout's base copy of the bucket (delta_base.DeltaBase.engine_matches)
and each is the bucket's tensor byte for byte (Engine.writable_params), writing the words the delta
wrote makes them exactly the new bucket, for O(changed words) rather than a copy of every byte.
The bucket's checksum comes from the copy's word sums (delta_base.py), checked before these words
are written, so nothing here checks anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.bus.delta.codec import Applied
from weightsync.bus.plan import BucketPlan

_WORD = {1: torch.uint8, 2: torch.int16}

#: (layout digest, bucket index, word bytes) -> the word positions each slot's tensor spans; the
#: layout fixes them, so a steady run of delta syncs searches a tensor of them per bucket
_BOUNDS: dict[tuple, torch.Tensor] = {}
_MAX_BOUNDS = 4096


@dataclass
class SlotWords:
    """The changed words of one tensor of a bucket: slot `slot`, word positions within the tensor
    (`local`) and the new words there."""

    slot: int
    local: torch.Tensor
    values: torch.Tensor


def slot_words(plan: BucketPlan, layout: str, applied: Applied, buf: torch.Tensor) -> list[SlotWords] | None:
    """Per tensor of bucket `plan`, the words `applied` wrote into the bucket `buf` (their values
    gathered now: O(changed words)); None when a tensor does not start and end on whole words."""
    word = applied.word
    key = (layout, plan.index, word)
    bounds = _BOUNDS.get(key)
    if bounds is None:
        flat = []
        for slot in plan.slots:
            if slot.offset % word or slot.meta.nbytes % word:
                return None
            flat += [slot.offset // word, (slot.offset + slot.meta.nbytes) // word]
        if len(_BOUNDS) >= _MAX_BOUNDS:
            _BOUNDS.clear()
        bounds = _BOUNDS[key] = torch.tensor(flat, dtype=torch.int64)
    pos = applied.positions
    cut = torch.searchsorted(pos, bounds.to(pos.device)).tolist()
    n = plan.nbytes - plan.nbytes % word
    src = buf[:n].view(_WORD[word])
    out = []
    for i, slot in enumerate(plan.slots):
        a, b = cut[2 * i], cut[2 * i + 1]
        if a < b:
            at = pos[a:b]
            out.append(SlotWords(i, at - slot.offset // word, src.index_select(0, at)))
    return out


def writable(params: Sequence[torch.Tensor] | None) -> bool:
    """The parameters can take a bucket word by word: each its own contiguous storage (a parameter
    two tensors write, tied embeddings, would hold only one of them: not the copy's bytes)."""
    if params is None:
        return False
    ptrs = [p.data_ptr() for p in params]
    return len(set(ptrs)) == len(ptrs) and all(p.is_contiguous() for p in params)


def write(words: list[SlotWords], params: Sequence[torch.Tensor], word: int) -> None:
    """Write `words` into `params` (one per slot of the bucket, as Engine.writable_params gives)."""
    dt = _WORD[word]
    for w in words:
        dst = params[w.slot].detach().reshape(-1).view(torch.uint8).view(dt)
        dst.index_put_((w.local.to(dst.device),), w.values.to(dst.device))
