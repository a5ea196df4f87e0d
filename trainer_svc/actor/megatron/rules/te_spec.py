"""Transformer-Engine layer-spec parameter names <-> the local-spec names the rule tables use.

megatron-core's TE spec (`get_gpt_layer_with_transformer_engine_spec`) differs from the local spec
this trainer builds in three ways that show in a state dict:
- the norm before attention is fused into `linear_qkv` (TELayerNormColumnParallelLinear), so
  `input_layernorm.weight` is `self_attention.linear_qkv.layer_norm_weight`; in *dense* layers the
  norm before the MLP is fused into `mlp.linear_fc1` the same way (`mlp.linear_fc1.layer_norm_weight`),
  while a MoE layer keeps a separate `pre_mlp_layernorm.weight` (TENorm): the experts share one norm;
- routed experts under TEGroupedMLP are `mlp.experts.linear_fc{1,2}.weight{e}` instead of
  SequentialMLP's `mlp.experts.local_experts.{e}.linear_fc{1,2}.weight`;
- TE modules carry `_extra_state` entries (FP8 recipe metadata, a serialized blob): no weights.
The tensors themselves are identical, so translating names is all a TE-named state dict needs to
go through the local-spec tables (mbridge's tables use the TE names; tests/unit/megatron/test_te_spec.py
checks the two agree). The MTP block's `transformer_layer` follows its decoder layer's spec.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeVar

from weightsync.model_spec import DENSE, Dims

T = TypeVar("T")

_QKV_NORM = ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
_FC1_NORM = ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
_TE_EXPERT = re.compile(r"^(?P<moe>.+\.mlp)\.experts\.linear_fc(?P<fc>[12])\.weight(?P<e>\d+)$")
_SEQ_EXPERT = re.compile(r"^(?P<moe>.+\.mlp)\.experts\.local_experts\.(?P<e>\d+)\.linear_fc(?P<fc>[12])\.weight$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def is_extra_state(name: str) -> bool:
    return name.endswith("._extra_state") or name == "_extra_state"


def _swap_suffix(name: str, old: str, new: str) -> str | None:
    return name[: -len(old)] + new if name.endswith("." + old) else None


def to_local(name: str) -> str | None:
    """The local-spec name of a TE-spec parameter (unchanged when both specs agree); None for
    `_extra_state`, which holds no weights."""
    if is_extra_state(name):
        return None
    for te, local in (_QKV_NORM, _FC1_NORM):
        out = _swap_suffix(name, te, local)
        if out is not None:
            return out
    m = _TE_EXPERT.match(name)
    if m:
        return f"{m['moe']}.experts.local_experts.{m['e']}.linear_fc{m['fc']}.weight"
    return name


def _kind(name: str, dims: Dims) -> str:
    m = _LAYER.match(name)
    if m:
        return dims.layer_kind(int(m.group(1)))
    # the MTP block's transformer_layer is built from the last decoder layer's spec
    return dims.layer_kind(dims.num_layers - 1) if dims.num_layers else DENSE


def to_te(name: str, dims: Dims) -> str:
    """The TE-spec name of a local-spec parameter (global layer numbering), TEGroupedMLP experts."""
    out = _swap_suffix(name, _QKV_NORM[1], _QKV_NORM[0])
    if out is not None:
        return out
    if _kind(name, dims) == DENSE:
        out = _swap_suffix(name, _FC1_NORM[1], _FC1_NORM[0])
        if out is not None:
            return out
    m = _SEQ_EXPERT.match(name)
    if m:
        return f"{m['moe']}.experts.linear_fc{m['fc']}.weight{m['e']}"
    return name


def local_state_dict(state: Mapping[str, T]) -> dict[str, T]:
    """A TE-spec (or already local-spec) state dict under local-spec names, `_extra_state` dropped.

    Raises ValueError when two entries land on one name (a state dict mixing both spellings).
    """
    out: dict[str, T] = {}
    source: dict[str, str] = {}
    for name, value in state.items():
        local = to_local(name)
        if local is None:
            continue
        if local in out:
            raise ValueError(
                f"state dict holds both {source[local]!r} and {name!r}, which are the same parameter "
                f"({local!r}) under the TE and local layer specs; keep one"
            )
        out[local], source[local] = value, name
    return out


def te_chunk_state_dict(state: Mapping[str, T], dims: Dims, global_layer: Mapping[int, int]) -> dict[str, T]:
    """A local-spec model chunk's plain state dict (chunk-local layer numbers, `global_layer` maps
    them to global ones) under TE-spec names, `_extra_state` dropped: TE's holds its FP8 recipe
    state, which a model built without Transformer Engine does not have. A layer's kind (dense or
    MoE) is looked up by its global number, so the pre-MLP norm is fused only where TE fuses it."""
    out: dict[str, T] = {}
    for name, value in state.items():
        if is_extra_state(name):
            continue
        m = _LAYER.match(name)
        if m:
            local_prefix, global_prefix = m.group(0), f"decoder.layers.{global_layer[int(m.group(1))]}."
            name = local_prefix + to_te(global_prefix + name[m.end() :], dims)[len(global_prefix) :]
        else:
            name = to_te(name, dims)
        out[name] = value
    return out


def spec_of(names) -> str:
    """'te' when any name is spelled the TE way, else 'local'."""
    for n in names:
        if is_extra_state(n) or n.endswith(("." + _QKV_NORM[0], "." + _FC1_NORM[0])) or _TE_EXPERT.match(n):
            return "te"
    return "local"
