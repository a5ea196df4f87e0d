"""Where each byte of a rule's HF tensors comes from: (destination, source) view pairs.

A Megatron parameter becomes its HF tensors by a split per TP shard (the rule's transform), the
concatenation of the shards along `tp_dim` and, for the vocabulary, a trim of the padding rows.
All three only move bytes, so they can be written as strided views: every pair is a region of an
HF tensor and the view of a shard that belongs there, and one `copy_` per pair (which casts too)
writes the HF tensors with each byte read once and written once, with no temporary. The HF tensors
may be fresh tensors or the slots of a bucket buffer (flat_export.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer_svc.actor.megatron.rules.base import Dims, Rule


def copy_pairs(
    rule: Rule, shards: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], d: Dims
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs whose copies write `outs` (the rule's HF tensors, in `rule.hf` order) from `shards`
    (the parameter's TP shards in TP rank order; one for a replicated parameter or TP=1)."""
    if len(outs) != len(rule.hf):
        raise ValueError(f"tensor {rule.megatron}: {len(outs)} HF tensors given, the rule makes {len(rule.hf)}")
    if rule.tp_dim is None and len(shards) != 1:
        raise ValueError(f"tensor {rule.megatron}: replicated across TP, yet {len(shards)} shards given")
    if rule.vocab and rule.transform.name != "identity":
        raise ValueError(f"tensor {rule.megatron}: a vocabulary rule must be an identity (rows are trimmed)")
    n, dim = len(shards), rule.tp_dim
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for r, shard in enumerate(shards):
        if dim is None:
            dsts = list(outs)
        elif rule.vocab:
            # shard r holds rows [r*rows, (r+1)*rows) of the padded table; rows past the HF
            # vocabulary are padding and go nowhere
            rows = shard.shape[dim]
            keep = min(rows, outs[0].shape[dim] - r * rows)
            if keep <= 0:
                continue
            shard = shard.narrow(dim, 0, keep)
            dsts = [o.narrow(dim, r * rows, keep) for o in outs]
        else:
            dsts = []
            for o in outs:
                if o.shape[dim] % n:
                    raise ValueError(
                        f"tensor {rule.megatron}: HF dim {dim} of size {o.shape[dim]} does not split into {n} TP shards"
                    )
                size = o.shape[dim] // n
                dsts.append(o.narrow(dim, r * size, size))
        pairs += rule.transform.hf_copies(shard, dsts, d)
    for dst, src in pairs:
        if dst.shape != src.shape:
            raise ValueError(
                f"tensor {rule.megatron}: a piece of shape {tuple(src.shape)} does not fit its "
                f"HF region {tuple(dst.shape)} (shards {[tuple(s.shape) for s in shards]})"
            )
    return pairs
