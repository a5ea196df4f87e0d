"""The rule-table vocabulary: a Rule maps one Megatron parameter (global layer numbering) to one or
more HF tensors through a pair of pure transforms.

Transforms work on *TP-local* pieces. Every HF tensor of a rule is cut into `tp` contiguous chunks
along `tp_dim`; rank r's Megatron shard is `to_megatron([chunk r of each HF tensor])`, and export is
the inverse, applied to each rank's shard before concatenating along `tp_dim`. Because a Megatron
shard always holds whole query groups / a whole gate slice plus the matching up slice, this makes
every transform independent of the TP size.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dims:
    """The shape facts transforms need, taken from the HF config."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups


@dataclass(frozen=True)
class Transform:
    """to_hf: Megatron TP-local tensor -> HF TP-local pieces; to_megatron: the inverse."""
    name: str
    to_hf: Callable[[torch.Tensor, Dims], list[torch.Tensor]]
    to_megatron: Callable[[Sequence[torch.Tensor], Dims], torch.Tensor]


#: where a parameter lives in the pipeline: before the layers, in a layer, after the layers
PRE, LAYER, POST = "pre", "layer", "post"


@dataclass(frozen=True)
class Rule:
    megatron: str                 # e.g. "decoder.layers.{layer}.mlp.linear_fc1.weight"
    hf: tuple[str, ...]           # e.g. ("model.layers.{layer}.mlp.gate_proj.weight", ...)
    transform: Transform
    tp_dim: int | None = None     # None: replicated across TP ranks
    vocab: bool = False           # rows are the (padded) vocabulary: trim on export, pad on load

    @property
    def section(self) -> str:
        if "{layer}" in self.megatron:
            return LAYER
        return PRE if self.megatron.startswith("embedding.") else POST

    def hf_names(self, layer: int | None = None) -> list[str]:
        return [h.format(layer=layer) for h in self.hf]

    def megatron_name(self, layer: int | None = None) -> str:
        return self.megatron.format(layer=layer)

    def pattern(self) -> re.Pattern:
        return re.compile("^" + re.escape(self.megatron).replace(r"\{layer\}", r"(?P<layer>\d+)") + "$")


@dataclass(frozen=True)
class RuleTable:
    family: str
    rules: tuple[Rule, ...]
    tied: bool

    def match(self, megatron_name: str) -> tuple[Rule, int | None]:
        """The rule for a Megatron parameter name (global layer numbering) and its layer."""
        for rule in self.rules:
            m = rule.pattern().match(megatron_name)
            if m:
                layer = m.groupdict().get("layer")
                return rule, (int(layer) if layer is not None else None)
        raise ValueError(f"tensor {megatron_name}: no rule in the {self.family!r} table maps it to HF")

    def ordered(self, num_layers: int) -> list[tuple[Rule, int | None]]:
        """Export order: embedding, then each layer's rules in table order, then final norm/head."""
        out = [(r, None) for r in self.rules if r.section == PRE]
        for layer in range(num_layers):
            out += [(r, layer) for r in self.rules if r.section == LAYER]
        out += [(r, None) for r in self.rules if r.section == POST]
        return out
