"""One table per model family; adding a family is adding an entry here and a test."""

from __future__ import annotations

from trainer_svc.actor.megatron.rules.base import RuleTable
from trainer_svc.actor.megatron.rules.dense import dense_rules
from trainer_svc.actor.megatron.rules.moe import moe_rules
from trainer_svc.actor.megatron.rules.mtp import mtp_rules

_DEFAULTS = dict(moe=False, shared_expert=None, shared_expert_gate=False)
# family -> the GPTModel features its checkpoints use
_FAMILIES = {
    "qwen2": dict(qkv_bias=True, qk_norm=False),  # q/k/v bias, no o_proj bias
    "llama": dict(qkv_bias=False, qk_norm=False),  # Llama 2/3: GQA, no biases
    "qwen3": dict(qkv_bias=False, qk_norm=True),  # per-head q/k RMSNorm, no biases
    "qwen3_moe": dict(qkv_bias=False, qk_norm=True, moe=True),  # routed experts only
    # Qwen1.5/Qwen2-MoE: q/k/v bias, routed experts plus one sigmoid-gated shared expert
    "qwen2_moe": dict(qkv_bias=True, qk_norm=False, moe=True, shared_expert="shared_expert", shared_expert_gate=True),
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
    return dict(_DEFAULTS, **_FAMILIES[base], tied=tied)


def rules_for(family: str, *, mtp: str = "off") -> RuleTable:
    """The family's table; mtp ('off', 'deepseek', 'mimo') adds the MTP block under that naming."""
    f = family_features(family)
    rules = dense_rules(qkv_bias=f["qkv_bias"], qk_norm=f["qk_norm"], tied=f["tied"])
    if f["moe"]:
        rules += moe_rules(shared_expert=f["shared_expert"], shared_expert_gate=f["shared_expert_gate"])
    rules += mtp_rules(mtp, rules, tied=f["tied"])
    return RuleTable(family=family, rules=rules, tied=f["tied"])
