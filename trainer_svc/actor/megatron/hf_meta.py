"""What the HF side looks like, from the model spec alone: tensor names and shapes, and the export order.

Names and shapes are those of the checkpoint on disk (`ModelSpec.hf_shapes`, read once from a
transformers model on the meta device, so they are checked against the real architecture). MTP
layers are not part of any transformers model: `build_spec` adds their names from the rule tables
and their shapes from the decoder layer they copy (see rules/mtp.py).
"""

from __future__ import annotations

import torch

from trainer_svc.actor.megatron.rules import Rule, Site, rules_for
from weightsync.bus.plan import TensorMeta
from weightsync.model_spec import ModelSpec


def _mtp_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    from trainer_svc.actor.megatron.rules.mtp import mtp_hf_shape

    shapes: dict[str, tuple[int, ...]] = {}
    if spec.mtp == "off":
        return shapes
    d = spec.dims
    for rule, site in rules_for(spec.family, mtp=spec.mtp).ordered(d):
        if rule.per_mtp:
            for n in rule.hf_names(site, d.num_layers):
                shapes[n] = mtp_hf_shape(n, d, spec.hf_shapes)
    return shapes


def build_spec(hf_config, mtp: str = "off", family: str | None = None) -> ModelSpec:
    """The Megatron actor's ModelSpec: the checkpoint's tensors plus its MTP layers when mtp is on.
    `family` overrides the config's own (to check a rule table against another model)."""
    return ModelSpec.from_hf(hf_config, mtp, family=family, extra_shapes=_mtp_shapes)


def export_plan(spec: ModelSpec) -> list[tuple[Rule, Site, list[str]]]:
    """(rule, site, HF names) in export order; refuses a table that misses or invents tensors."""
    family, shapes, d = spec.family, spec.hf_shapes, spec.dims
    table = rules_for(family, mtp=spec.mtp)
    if table.tied != spec.tied:
        raise ValueError(f"family {family!r} and tie_word_embeddings={spec.hf_config.tie_word_embeddings} disagree")
    plan, named = [], set()
    for rule, site in table.ordered(d):
        names = rule.hf_names(site, d.num_layers)
        for n in names:
            if n not in shapes:
                raise ValueError(
                    f"tensor {n}: the {family!r} rule table names it but the transformers "
                    f"{spec.hf_config.model_type} model has no such tensor"
                )
        named.update(names)
        plan.append((rule, site, names))
    unmapped = sorted(set(shapes) - named - ({"lm_head.weight"} if table.tied else set()))
    if unmapped:
        raise ValueError(
            f"tensor {unmapped[0]}: the transformers model has it but the {family!r} rule table "
            f"does not ({len(unmapped)} unmapped)"
        )
    return plan


def export_metas(spec: ModelSpec, export_dtype: torch.dtype) -> list[TensorMeta]:
    return [TensorMeta(n, spec.hf_shapes[n], export_dtype) for _, _, names in export_plan(spec) for n in names]
