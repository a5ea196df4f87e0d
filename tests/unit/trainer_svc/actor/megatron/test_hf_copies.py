"""Every transform's `hf_copies` writes exactly what its `to_hf` returns (the flat export and the
per-tensor export rely on it), and copy_pairs assembles TP shards and trims the vocabulary as the
concatenation did."""

from __future__ import annotations

import pytest
import torch

from trainer_svc.actor.megatron.hf_copy import copy_pairs
from trainer_svc.actor.megatron.rules.base import Rule
from trainer_svc.actor.megatron.rules.transforms import (
    GATE_UP,
    IDENTITY,
    QKV,
    SWAP_HALVES,
)
from weightsync.model_spec import Dims


def _dims(heads=8, groups=2, head_dim=4, vocab=250) -> Dims:
    return Dims(
        num_layers=1,
        hidden_size=16,
        num_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        ffn_hidden_size=12,
        vocab_size=vocab,
    )


@pytest.mark.parametrize("transform,rows", [(IDENTITY, 10), (QKV, 2 * (4 + 2) * 4), (GATE_UP, 24), (SWAP_HALVES, 6)])
@pytest.mark.parametrize("bias", [False, True])
def test_hf_copies_equal_to_hf(transform, rows, bias):
    d = _dims()
    t = torch.randn(rows) if bias else torch.randn(rows, 16)
    if bias and transform is SWAP_HALVES:
        pytest.skip("swap_halves acts on 2-D weights only")
    want = transform.to_hf(t, d)
    outs = [torch.full(w.shape, float("nan"), dtype=torch.bfloat16) for w in want]
    for dst, src in transform.hf_copies(t, outs, d):
        dst.copy_(src)
    for w, o in zip(want, outs, strict=True):
        assert torch.equal(o, w.to(torch.bfloat16))
    if transform.to_hf_views:
        assert all(w.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for w in want)


def _cat_reference(rule, shards, d):
    per = [rule.transform.to_hf(s, d) for s in shards]
    out = [torch.cat([p[i] for p in per], dim=rule.tp_dim or 0) for i in range(len(rule.hf))]
    return [o[: d.vocab_size] for o in out] if rule.vocab else out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    "rule",
    [
        Rule("qkv", ("q", "k", "v"), QKV, tp_dim=0),
        Rule("fc1", ("g", "u"), GATE_UP, tp_dim=0),
        Rule("proj", ("o",), IDENTITY, tp_dim=1),
        Rule("emb", ("e",), IDENTITY, tp_dim=0, vocab=True),
        Rule("eh", ("i",), SWAP_HALVES, tp_dim=0),
    ],
    ids=lambda r: r.megatron,
)
def test_copy_pairs_assemble_like_the_concatenation(rule, tp):
    d = _dims(groups=4)
    if rule.megatron == "proj":  # split along columns
        shards = [torch.randn(16, 16 // tp) for _ in range(tp)]
    else:
        rows = {"qkv": 4 * (2 + 2) * 4, "fc1": 24, "emb": 256, "eh": 8}[rule.megatron] // tp
        shards = [torch.randn(rows, 16) for _ in range(tp)]
    want = _cat_reference(rule, shards, d)
    outs = [torch.empty_like(w) for w in want]
    for dst, src in copy_pairs(rule, shards, outs, d):
        dst.copy_(src)
    for w, o in zip(want, outs, strict=True):
        assert torch.equal(o, w)


def test_copy_pairs_refuse_a_mismatch():
    d = _dims()
    rule = Rule("fc1", ("g", "u"), GATE_UP, tp_dim=0)
    with pytest.raises(ValueError, match="does not fit its HF region"):
        copy_pairs(rule, [torch.randn(24, 16)], [torch.empty(10, 16), torch.empty(12, 16)], d)
    with pytest.raises(ValueError, match="2 HF tensors given|1 HF tensors given"):
        copy_pairs(rule, [torch.randn(24, 16)], [torch.empty(24, 16)], d)
