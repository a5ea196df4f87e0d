"""Mixture-of-experts layer rules (Qwen2-MoE / Qwen3-MoE on-disk names).

Megatron's MoELayer holds `router.weight` [num_experts, hidden], the routed experts and optionally a
shared expert. Experts are named here in their *sequential* layout with a global index,
`mlp.experts.local_experts.{expert}.linear_fc1|2.weight`; the grouped layouts (legacy GroupedMLP
`weight1/weight2`, TEGroupedMLP `linear_fc1.weight{i}`) are presented under the same names by
`trainer_svc/actor/megatron/param_names.py`, so one table serves every layout. Each expert's fc1 fuses
[gate; up] like the dense MLP and is split the same way (per expert-TP rank).

HF names are the checkpoint's (what `save_pretrained` writes and SGLang's load_weights reads):
`mlp.experts.{e}.{gate,up,down}_proj.weight`, router `mlp.gate.weight`; transformers 5 fuses the
experts into `mlp.experts.gate_up_proj` in memory and converts on load/save (conversion_mapping.py).
"""

from __future__ import annotations

from trainer_svc.actor.megatron.rules.base import MOE, Rule
from trainer_svc.actor.megatron.rules.transforms import GATE_UP, IDENTITY

L = "decoder.layers.{layer}.mlp."
H = "model.layers.{layer}.mlp."


def moe_rules(*, shared_expert: str | None, shared_expert_gate: bool) -> tuple[Rule, ...]:
    """shared_expert: the HF module name of the always-on expert (Qwen2-MoE `shared_expert`,
    DeepSeek `shared_experts`), or None; shared_expert_gate: Qwen2-MoE's sigmoid gate on it."""
    ex = L + "experts.local_experts.{expert}."
    hx = H + "experts.{expert}."
    rules = [
        Rule(L + "router.weight", (H + "gate.weight",), IDENTITY, layers=MOE),
        Rule(ex + "linear_fc1.weight", (hx + "gate_proj.weight", hx + "up_proj.weight"), GATE_UP, tp_dim=0, layers=MOE),
        Rule(ex + "linear_fc2.weight", (hx + "down_proj.weight",), IDENTITY, tp_dim=1, layers=MOE),
    ]
    if shared_expert:
        sx, hs = L + "shared_experts.", H + shared_expert + "."
        rules += [
            Rule(
                sx + "linear_fc1.weight",
                (hs + "gate_proj.weight", hs + "up_proj.weight"),
                GATE_UP,
                tp_dim=0,
                layers=MOE,
            ),
            Rule(sx + "linear_fc2.weight", (hs + "down_proj.weight",), IDENTITY, tp_dim=1, layers=MOE),
        ]
        if shared_expert_gate:
            # [1, hidden], replicated: output = sigmoid(x @ gate.T) * shared_expert(x) on both sides
            rules.append(Rule(sx + "gate_weight", (H + "shared_expert_gate.weight",), IDENTITY, layers=MOE))
    return tuple(rules)
