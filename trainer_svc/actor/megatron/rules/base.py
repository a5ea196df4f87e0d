"""The rule-table vocabulary: a Rule maps one Megatron parameter (global layer and expert numbering)
to one or more HF tensors through a pair of pure transforms.

Transforms work on *TP-local* pieces. Every HF tensor of a rule is cut into `tp` contiguous chunks
along `tp_dim`; rank r's Megatron shard is `to_megatron([chunk r of each HF tensor])`, and export is
the inverse, applied to each rank's shard before concatenating along `tp_dim`. Because a Megatron
shard always holds whole query groups / a whole gate slice plus the matching up slice, this makes
every transform independent of the TP size. (For an expert parameter "tp" is the expert-TP group.)

A rule's names carry placeholders for where it repeats: `{layer}` (global decoder layer),
`{expert}` (global expert index), `{mtp}` (multi-token-prediction depth) and, on the HF side only,
`{mtp_layer}` = num_layers + mtp (DeepSeek-V3 numbers its MTP layers after the decoder's).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trainer_svc.actor.megatron.rules.te_spec import to_local
from weightsync.model_spec import DENSE, MOE, Dims  # noqa: F401 (MOE re-exported for the rule tables)


@dataclass(frozen=True)
class Transform:
    """to_hf: Megatron TP-local tensor -> HF TP-local pieces; to_megatron: the inverse.

    hf_copies: the same conversion as to_hf, written into given HF TP-local pieces instead of new
    tensors: (destination view, source view) pairs whose `copy_` (which may also cast) writes each
    byte once, with no temporary (the export straight into a bucket: trainer_svc/actor/megatron/
    flat_export.py). to_hf_views: to_hf returns views of its argument (no copy at all)."""

    name: str
    to_hf: Callable[[torch.Tensor, Dims], list[torch.Tensor]]
    to_megatron: Callable[[Sequence[torch.Tensor], Dims], torch.Tensor]
    hf_copies: Callable[[torch.Tensor, Sequence[torch.Tensor], Dims], list[tuple[torch.Tensor, torch.Tensor]]]
    to_hf_views: bool = False


#: where a parameter lives in the pipeline: before the layers, in a layer, after the layers (the
#: final norm, the output layer and the MTP block, which megatron places on the last stage)
PRE, LAYER, POST = "pre", "layer", "post"
#: which decoder layers a layer rule applies to
ALL = "all"  # with DENSE and MOE (weightsync.model_spec): which decoder layers a rule covers


@dataclass(frozen=True)
class Site:
    """One place a rule applies: global decoder layer, global expert, MTP depth (None: n/a)."""

    layer: int | None = None
    expert: int | None = None
    mtp: int | None = None


@dataclass(frozen=True)
class Rule:
    megatron: str  # e.g. "decoder.layers.{layer}.mlp.linear_fc1.weight"
    hf: tuple[str, ...]  # e.g. ("model.layers.{layer}.mlp.gate_proj.weight", ...)
    transform: Transform
    tp_dim: int | None = None  # None: replicated across TP ranks
    vocab: bool = False  # rows are the (padded) vocabulary: trim on export, pad on load
    layers: str = ALL  # ALL, DENSE or MOE: which decoder layers have this parameter
    # a second HF copy of a parameter that another rule loads (DeepSeek-V3's per-MTP-layer
    # embed_tokens / shared_head.head): exported, never loaded from
    export_only: bool = False

    @property
    def section(self) -> str:
        if "{layer}" in self.megatron:
            return LAYER
        return PRE if self.megatron.startswith("embedding.") else POST

    @property
    def expert(self) -> bool:
        """Held by the expert-parallel rank of its expert and split over the expert-TP group."""
        return "{expert}" in self.megatron

    @property
    def per_mtp(self) -> bool:
        return "{mtp}" in self.megatron or any("{mtp" in h for h in self.hf)

    def hf_names(self, site: Site = Site(), num_layers: int = 0) -> list[str]:
        mtp_layer = None if site.mtp is None else num_layers + site.mtp
        return [h.format(layer=site.layer, expert=site.expert, mtp=site.mtp, mtp_layer=mtp_layer) for h in self.hf]

    def megatron_name(self, site: Site = Site()) -> str:
        return self.megatron.format(layer=site.layer, expert=site.expert, mtp=site.mtp)

    def pattern(self) -> re.Pattern:
        p = "^" + re.escape(self.megatron) + "$"
        for key in ("layer", "expert", "mtp"):
            p = p.replace(re.escape("{" + key + "}"), f"(?P<{key}>\\d+)")
        return re.compile(p)


@dataclass(frozen=True)
class RuleTable:
    family: str
    rules: tuple[Rule, ...]
    tied: bool

    def match(self, megatron_name: str) -> tuple[Rule, Site]:
        """The rule loading a Megatron parameter name (global layer/expert numbering), and where.
        TE-spec names are accepted too: they are read as the local-spec parameter they spell."""
        local = to_local(megatron_name)
        if local is None:
            raise ValueError(f"tensor {megatron_name}: TE `_extra_state` holds no weights; no rule maps it to HF")
        megatron_name = local
        for rule in self.rules:
            if rule.export_only:
                continue
            m = rule.pattern().match(megatron_name)
            if m:
                return rule, Site(**{k: int(v) for k, v in m.groupdict().items()})
        raise ValueError(f"tensor {megatron_name}: no rule in the {self.family!r} table maps it to HF")

    def _expand(self, rules: list[Rule], d: Dims, layer: int | None = None, mtp: int | None = None):
        out = []
        for r in rules:
            experts = range(d.num_experts) if "{expert}" in r.megatron else [None]
            out += [(r, Site(layer=layer, expert=e, mtp=mtp)) for e in experts]
        return out

    def ordered(self, d: Dims) -> list[tuple[Rule, Site]]:
        """Export order: embedding, each decoder layer (its experts in index order), final norm and
        head, then each MTP depth (shaped like the last decoder layer, as megatron builds it)."""
        plain = [r for r in self.rules if not r.per_mtp]
        out = self._expand([r for r in plain if r.section == PRE], d)
        for layer in range(d.num_layers):
            kind = d.layer_kind(layer)
            out += self._expand([r for r in plain if r.section == LAYER and r.layers in (ALL, kind)], d, layer=layer)
        out += self._expand([r for r in plain if r.section == POST], d)
        mtp_kind = d.layer_kind(d.num_layers - 1) if d.num_layers else DENSE
        for depth in range(d.mtp_layers):
            out += self._expand([r for r in self.rules if r.per_mtp and r.layers in (ALL, mtp_kind)], d, mtp=depth)
        return out
