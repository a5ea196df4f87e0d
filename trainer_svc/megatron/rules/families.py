"""One table per model family; adding a family is adding an entry here and a test."""
from __future__ import annotations

from trainer_svc.megatron.rules.base import RuleTable
from trainer_svc.megatron.rules.dense import dense_rules

# family -> the GPTModel features its checkpoints use
_FAMILIES = {
    "qwen2": dict(qkv_bias=True, qk_norm=False),    # q/k/v bias, no o_proj bias
    "llama": dict(qkv_bias=False, qk_norm=False),   # Llama 2/3: GQA, no biases
    "qwen3": dict(qkv_bias=False, qk_norm=True),    # per-head q/k RMSNorm, no biases
}


def known_families() -> list[str]:
    return sorted(list(_FAMILIES) + [f + "-tied" for f in _FAMILIES])


def base_family(family: str) -> tuple[str, bool]:
    """'qwen2-tied' -> ('qwen2', True)."""
    tied = family.endswith("-tied")
    base = family[: -len("-tied")] if tied else family
    if base not in _FAMILIES:
        raise ValueError(f"model family {family!r} has no Megatron rule table; known: {known_families()}")
    return base, tied


def family_features(family: str) -> dict:
    base, tied = base_family(family)
    return dict(_FAMILIES[base], tied=tied)


def rules_for(family: str) -> RuleTable:
    base, tied = base_family(family)
    return RuleTable(family=family, rules=dense_rules(**_FAMILIES[base], tied=tied), tied=tied)
