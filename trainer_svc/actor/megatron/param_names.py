"""This rank's Megatron parameters under the names the rule tables use.

Megatron's own names are local: a chunk numbers its decoder layers from 0, an expert-parallel rank
numbers its experts from 0, and the expert layouts differ (SequentialMLP
`local_experts.{i}.linear_fc1.weight`, TEGroupedMLP `linear_fc1.weight{i}`, legacy GroupedMLP one
`weight1`/`weight2` for all local experts). Here every parameter gets its global layer and global
expert index, and every layout is shown as the sequential one, so the tables need one set of expert
rules; a TE-spec model's fused norm names (`linear_qkv.layer_norm_weight`) are shown as the local
spec's (`rules/te_spec.py`). A grouped layout's experts are *views* into weight1/weight2, so load writes through
them and
export reads them without a copy.
"""

from __future__ import annotations

import re

import torch

from trainer_svc.actor.megatron.rules.te_spec import to_local

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERTS = re.compile(
    r"^(?P<moe>.+\.mlp)\.experts\.(?:local_experts\.(?P<seq>\d+)\.(?P<rest>.+)"
    r"|linear_fc(?P<te_fc>[12])\.weight(?P<te>\d+)|weight(?P<grouped>[12]))$"
)


def grouped_expert_views(
    weight1: torch.Tensor, weight2: torch.Tensor, num_local_experts: int, hidden_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per local expert (fc1, fc2) views of a legacy GroupedMLP's weights, in linear-layer layout.

    GroupedMLP.forward runs expert e as `x @ weight1.view(E, hidden, -1)[e]` then, after the GLU,
    `@ weight2.view(E, -1, hidden)[e]`: each expert's block is the *transpose* of a linear weight, and
    the GLU chunks fc1's output columns into [gate | up]. So fc1 = block1[e].T is [2*ffn, hidden] with
    rows [gate; up] and fc2 = block2[e].T is [hidden, ffn], exactly SequentialMLP's linear_fc1/fc2
    (and, per expert-TP rank, its shards)."""
    if weight1.numel() % (num_local_experts * hidden_size) or weight2.numel() % (num_local_experts * hidden_size):
        raise ValueError(
            f"GroupedMLP weights {tuple(weight1.shape)} / {tuple(weight2.shape)} do not hold "
            f"{num_local_experts} experts of hidden_size={hidden_size}"
        )
    w1 = weight1.view(num_local_experts, hidden_size, -1)
    w2 = weight2.view(num_local_experts, -1, hidden_size)
    return [(w1[e].t(), w2[e].t()) for e in range(num_local_experts)]


def _expert_entries(chunk, name: str, p: torch.Tensor, m: re.Match) -> list[tuple[str, torch.Tensor]]:
    moe = chunk.get_submodule(m["moe"])
    index = list(moe.local_expert_indices)  # local -> global expert index on this EP rank
    base = f"{m['moe']}.experts.local_experts."
    if m["seq"] is not None:
        return [(f"{base}{index[int(m['seq'])]}.{m['rest']}", p)]
    if m["te"] is not None:
        return [(f"{base}{index[int(m['te'])]}.linear_fc{m['te_fc']}.weight", p)]
    if m["grouped"] == "2":
        return []  # emitted together with weight1
    experts = moe.experts
    views = grouped_expert_views(
        experts.weight1, experts.weight2, experts.num_local_experts, experts.config.hidden_size
    )
    out = []
    for local, (fc1, fc2) in enumerate(views):
        out += [(f"{base}{index[local]}.linear_fc1.weight", fc1), (f"{base}{index[local]}.linear_fc2.weight", fc2)]
    return out


def named_parameters_global(chunks) -> dict[str, torch.Tensor]:
    """This rank's parameters keyed by Megatron name with GLOBAL layer and expert numbers
    (layer.layer_number is global and 1-based; the module path's index is local to the chunk)."""
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        local_to_global = {}
        if hasattr(chunk, "decoder"):
            for i, layer in enumerate(chunk.decoder.layers):
                local_to_global[i] = layer.layer_number - 1
        for name, p in chunk.named_parameters():
            m = _EXPERTS.match(name)
            entries = _expert_entries(chunk, name, p, m) if m else [(name, p)]
            for n, t in entries:
                layer = _LAYER.match(n)
                if layer:
                    n = f"decoder.layers.{local_to_global[int(layer.group(1))]}.{n[layer.end() :]}"
                # a model built with the TE spec names its fused norms the TE way
                out[to_local(n) or n] = t
    return out
