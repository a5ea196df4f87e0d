"""Mixture-of-experts: which layers are MoE and the megatron-core MoE settings that reproduce the
HF model's routing exactly (Qwen2-MoE / Qwen3-MoE)."""

from __future__ import annotations

import torch

#: how experts are laid out in the Megatron model: one module per expert (SequentialMLP), or the
#: legacy GroupedMLP (weight1/weight2 for all local experts; needs the grouped_gemm package and bf16)
EXPERT_LAYOUTS = ("sequential", "grouped")


def check_moe_supported(hf_config, features: dict) -> None:
    c = hf_config
    if not features["moe"]:
        if getattr(c, "num_experts", None):
            raise ValueError(f"num_experts={c.num_experts} but model_type={c.model_type!r} has no MoE rule table")
        return
    topk, experts = int(c.num_experts_per_tok), int(c.num_experts)
    if not 1 <= topk <= experts:
        raise ValueError(f"num_experts_per_tok={topk} must be in [1, num_experts={experts}]")
    if features["shared_expert"] and not getattr(c, "shared_expert_intermediate_size", 0):
        raise ValueError(f"model_type={c.model_type!r} needs shared_expert_intermediate_size > 0")


def moe_config_fields(
    hf_config, features: dict, moe_layers: tuple[bool, ...], ep: int, expert_tp: int, expert_layout: str
) -> dict:
    """TransformerConfig keyword arguments for the MoE part (empty for a dense model)."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r} is not one of {EXPERT_LAYOUTS}")
    if not any(moe_layers):
        return dict(expert_model_parallel_size=ep, expert_tensor_parallel_size=expert_tp)
    c = hf_config
    shared = int(getattr(c, "shared_expert_intermediate_size", 0) or 0) if features["shared_expert"] else 0
    return dict(
        num_moe_experts=int(c.num_experts),
        moe_ffn_hidden_size=int(c.moe_intermediate_size),
        moe_layer_freq=[int(m) for m in moe_layers],
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp,
        moe_router_topk=int(c.num_experts_per_tok),
        moe_router_score_function="softmax",
        # HF: softmax over all experts, top-k, then (norm_topk_prob) renormalise the k weights.
        # megatron: pre_softmax=True is softmax-then-top-k without renormalising; pre_softmax=False
        # is top-k logits then softmax over those k, which equals the renormalised weights.
        moe_router_pre_softmax=not bool(getattr(c, "norm_topk_prob", False)),
        # no auxiliary losses: the trainer's loss is the RL objective alone; routing is unchanged
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        # alltoall is megatron's fast path but allocates a torch.cuda.Stream at construction; on a
        # CPU host the allgather dispatcher computes the same routing and expert outputs
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared and features["shared_expert_gate"]),
        moe_grouped_gemm=expert_layout == "grouped",
    )
