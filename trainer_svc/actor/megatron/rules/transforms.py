"""Pure tensor transforms between Megatron's fused layouts and HF's separate tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer_svc.actor.megatron.rules.base import Dims, Transform


def _identity_to_hf(t: torch.Tensor, d: Dims) -> list[torch.Tensor]:
    return [t]


def _identity_to_megatron(parts: Sequence[torch.Tensor], d: Dims) -> torch.Tensor:
    (t,) = parts
    return t


def _identity_copies(t: torch.Tensor, dsts: Sequence[torch.Tensor], d: Dims) -> list[tuple[torch.Tensor, torch.Tensor]]:
    (dst,) = dsts
    return [(dst, t)]


# Megatron's linear_qkv rows are grouped by query group, not by q/k/v: for each KV head g it holds
# the heads_per_group query heads that attend with g, then k_g, then v_g. That keeps one query group
# (its q heads and the k/v they share) together, so a TP split along rows hands each rank whole
# groups and attention needs no communication. HF keeps q_proj, k_proj, v_proj separate, with q heads
# ordered so that head h uses KV head h // heads_per_group, i.e. the same grouping, flattened.
def _qkv_groups(t: torch.Tensor, d: Dims) -> tuple[torch.Tensor, ...]:
    """(q, k, v) as strided views [groups, rows, ...] of the fused rows (no copy)."""
    hpg, hd = d.heads_per_group, d.head_dim
    rows_per_group = (hpg + 2) * hd
    if t.shape[0] % rows_per_group:
        raise ValueError(
            f"linear_qkv has {t.shape[0]} rows, not a multiple of (heads_per_group+2)*head_dim="
            f"{rows_per_group} (num_attention_heads={d.num_heads}, "
            f"num_key_value_heads={d.num_query_groups}, head_dim={hd})"
        )
    groups = t.shape[0] // rows_per_group
    g = t.reshape(groups, rows_per_group, *t.shape[1:])
    return torch.split(g, [hpg * hd, hd, hd], dim=1)


def _qkv_to_hf(t: torch.Tensor, d: Dims) -> list[torch.Tensor]:
    return [x.reshape(-1, *t.shape[1:]) for x in _qkv_groups(t, d)]


def _qkv_copies(t: torch.Tensor, dsts: Sequence[torch.Tensor], d: Dims) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # each HF piece is contiguous rows, read as [groups, rows per group, ...]: `view`, never `reshape`,
    # so that a destination that cannot be viewed so raises instead of silently becoming a copy
    return [(dst.view(src.shape), src) for dst, src in zip(dsts, _qkv_groups(t, d), strict=True)]


def _qkv_to_megatron(parts: Sequence[torch.Tensor], d: Dims) -> torch.Tensor:
    q, k, v = parts
    hpg, hd = d.heads_per_group, d.head_dim
    groups = k.shape[0] // hd
    if q.shape[0] != groups * hpg * hd or v.shape[0] != k.shape[0] or k.shape[0] % hd:
        raise ValueError(
            f"q/k/v rows {q.shape[0]}/{k.shape[0]}/{v.shape[0]} do not fit num_attention_heads="
            f"{d.num_heads}, num_key_value_heads={d.num_query_groups}, head_dim={hd}"
        )
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, hpg * hd, *rest), k.reshape(groups, hd, *rest), v.reshape(groups, hd, *rest)], dim=1
    )
    return fused.reshape(-1, *rest)


# linear_fc1 fuses the SwiGLU gate and up projections as [gate; up] on every TP rank (each rank
# holds its slice of both), which is why the split is done per rank, before the TP concatenation.
def _gate_up_to_hf(t: torch.Tensor, d: Dims) -> list[torch.Tensor]:
    gate, up = torch.chunk(t, 2, dim=0)
    return [gate, up]


def _gate_up_to_megatron(parts: Sequence[torch.Tensor], d: Dims) -> torch.Tensor:
    gate, up = parts
    return torch.cat([gate, up], dim=0)


def _gate_up_copies(t: torch.Tensor, dsts: Sequence[torch.Tensor], d: Dims) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(dsts, _gate_up_to_hf(t, d), strict=True))


IDENTITY = Transform("identity", _identity_to_hf, _identity_to_megatron, _identity_copies, to_hf_views=True)
QKV = Transform("qkv", _qkv_to_hf, _qkv_to_megatron, _qkv_copies)
GATE_UP = Transform("gate_up", _gate_up_to_hf, _gate_up_to_megatron, _gate_up_copies, to_hf_views=True)


# Megatron's MTP eh_proj reads cat(enorm(embedding), hnorm(hidden)) (multi_token_prediction.py,
# _concat_embeddings), as DeepSeek-V3's eh_proj does; MiMo's input_proj reads cat(hidden, embedding)
# (vLLM / SGLang mimo_mtp.py). Swapping the two column halves converts one into the other; it acts
# within each row, so it commutes with the row (TP) split.
def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    if t.shape[-1] % 2:
        raise ValueError(f"MTP input projection has {t.shape[-1]} columns, expected 2*hidden_size")
    first, second = torch.chunk(t, 2, dim=-1)
    return torch.cat([second, first], dim=-1)


def _swap_to_hf(t: torch.Tensor, d: Dims) -> list[torch.Tensor]:
    return [_swap_halves(t)]


def _swap_to_megatron(parts: Sequence[torch.Tensor], d: Dims) -> torch.Tensor:
    (t,) = parts
    return _swap_halves(t)


def _swap_copies(t: torch.Tensor, dsts: Sequence[torch.Tensor], d: Dims) -> list[tuple[torch.Tensor, torch.Tensor]]:
    (dst,) = dsts
    if t.shape[-1] % 2:
        raise ValueError(f"MTP input projection has {t.shape[-1]} columns, expected 2*hidden_size")
    first, second = torch.chunk(t, 2, dim=-1)
    out_first, out_second = torch.chunk(dst, 2, dim=-1)
    return [(out_first, second), (out_second, first)]


SWAP_HALVES = Transform("swap_halves", _swap_to_hf, _swap_to_megatron, _swap_copies)
