"""What the HF side looks like, from config alone: tensor names and shapes, and the export order.

Names and shapes are those of the checkpoint on disk (what `save_pretrained` writes and SGLang's
load_weights reads), taken from a transformers model on the meta device, so they are checked against
the real architecture. transformers 5 keeps some tensors fused in memory (MoE experts as one
`gate_up_proj` [E, 2F, H]) and converts them when saving; `revert_weight_conversion` applies that same
conversion to the meta state dict. MTP layers are not part of any transformers model: their shapes
come from the decoder layer they copy (see rules/mtp.py).
"""
from __future__ import annotations

import torch

from weightsync.bus.plan import TensorMeta
from trainer_svc.actor.megatron.rules import Rule, Site, rules_for

_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {}


def _model_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    # keyed by the config's JSON so an export does not rebuild the meta model every time
    key = hf_config.to_json_string(use_diff=False)
    if key not in _SHAPES:
        from transformers import AutoModelForCausalLM
        from transformers.core_model_loading import revert_weight_conversion

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        on_disk = revert_weight_conversion(model, model.state_dict())
        _SHAPES.clear()
        _SHAPES[key] = {n: tuple(t.shape) for n, t in on_disk.items()}
    return _SHAPES[key]


def hf_shapes(hf_config, mtp: str = "off") -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of the checkpoint (plus its MTP layers when mtp is on)."""
    from trainer_svc.actor.megatron.model import dims_of, family_of_config
    from trainer_svc.actor.megatron.rules.mtp import mtp_hf_shape

    shapes = dict(_model_shapes(hf_config))
    if mtp != "off":
        d = dims_of(hf_config, mtp)
        for rule, site in rules_for(family_of_config(hf_config), mtp=mtp).ordered(d):
            if rule.per_mtp:
                for n in rule.hf_names(site, d.num_layers):
                    shapes[n] = mtp_hf_shape(n, d, shapes)
    return shapes


def export_plan(hf_config, family: str, mtp: str = "off") -> list[tuple[Rule, Site, list[str]]]:
    """(rule, site, HF names) in export order; refuses a table that misses or invents tensors."""
    from trainer_svc.actor.megatron.model import dims_of

    table = rules_for(family, mtp=mtp)
    if table.tied != bool(getattr(hf_config, "tie_word_embeddings", False)):
        raise ValueError(f"family {family!r} and tie_word_embeddings={hf_config.tie_word_embeddings} disagree")
    d = dims_of(hf_config, mtp)
    shapes = hf_shapes(hf_config, mtp)
    plan, named = [], set()
    for rule, site in table.ordered(d):
        names = rule.hf_names(site, d.num_layers)
        for n in names:
            if n not in shapes:
                raise ValueError(f"tensor {n}: the {family!r} rule table names it but the transformers "
                                 f"{hf_config.model_type} model has no such tensor")
        named.update(names)
        plan.append((rule, site, names))
    unmapped = sorted(set(shapes) - named - ({"lm_head.weight"} if table.tied else set()))
    if unmapped:
        raise ValueError(f"tensor {unmapped[0]}: the transformers model has it but the {family!r} rule table "
                         f"does not ({len(unmapped)} unmapped)")
    return plan


def export_metas(hf_config, family: str, export_dtype: torch.dtype, mtp: str = "off") -> list[TensorMeta]:
    shapes = hf_shapes(hf_config, mtp)
    return [TensorMeta(n, shapes[n], export_dtype) for _, _, names in export_plan(hf_config, family, mtp)
            for n in names]
