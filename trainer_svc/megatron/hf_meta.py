"""What the HF side looks like, from config alone: tensor shapes (a transformers model on the meta
device, so shapes are checked against the real architecture) and the export order of the table."""
from __future__ import annotations

import torch

from weightsync.bus.plan import TensorMeta
from trainer_svc.megatron.rules import Rule, rules_for


_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {}


def hf_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    # keyed by the config's JSON so an export does not rebuild the meta model every time
    key = hf_config.to_json_string(use_diff=False)
    if key not in _SHAPES:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        _SHAPES.clear()
        _SHAPES[key] = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    return dict(_SHAPES[key])


def export_plan(hf_config, family: str) -> list[tuple[Rule, int | None, list[str]]]:
    """(rule, global layer, HF names) in export order; refuses a table that misses or invents tensors."""
    table = rules_for(family)
    if table.tied != bool(getattr(hf_config, "tie_word_embeddings", False)):
        raise ValueError(f"family {family!r} and tie_word_embeddings={hf_config.tie_word_embeddings} disagree")
    shapes = hf_shapes(hf_config)
    plan, named = [], set()
    for rule, layer in table.ordered(hf_config.num_hidden_layers):
        names = rule.hf_names(layer)
        for n in names:
            if n not in shapes:
                raise ValueError(f"tensor {n}: the {family!r} rule table names it but the transformers "
                                 f"{hf_config.model_type} model has no such tensor")
        named.update(names)
        plan.append((rule, layer, names))
    unmapped = sorted(set(shapes) - named - ({"lm_head.weight"} if table.tied else set()))
    if unmapped:
        raise ValueError(f"tensor {unmapped[0]}: the transformers model has it but the {family!r} rule table "
                         f"does not ({len(unmapped)} unmapped)")
    return plan


def export_metas(hf_config, family: str, export_dtype: torch.dtype) -> list[TensorMeta]:
    shapes = hf_shapes(hf_config)
    return [TensorMeta(n, shapes[n], export_dtype) for _, _, names in export_plan(hf_config, family) for n in names]
