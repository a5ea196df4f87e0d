"""HF tensor names for the architectures of bench/model_arch.py: the manifests of the control-plane bench.

model_arch counts shapes; the control plane also needs the names (the rollout checks each against
its engine, and block FP8 pairs a weight with its scale by name). These follow the HF checkpoints:
Qwen3-MoE (`mlp.gate`, `mlp.experts.E.*_proj`, `q_norm`/`k_norm`) and DeepSeek-V3 / Kimi-K2 (MLA
projections, `mlp.shared_experts.*`). The order and shapes are model_arch's, so the counts agree
with `footprint()` (a test holds them to it). Pure Python, no torch.
"""

from __future__ import annotations

from bench.model_arch import Arch, Tensor, embedding_tensors, head_tensors, layer_tensors

_MLA_ATTN = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
_GQA_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _layer_names(a: Arch, i: int) -> list[str]:
    p = f"model.layers.{i}"
    out = [f"{p}.input_layernorm.weight"]
    if a.mla:
        out += [f"{p}.self_attn.{n}.weight" for n in _MLA_ATTN]
    else:
        out += [f"{p}.self_attn.{n}.weight" for n in _GQA_ATTN]
        if a.qkv_bias:
            out += [f"{p}.self_attn.{n}.bias" for n in _GQA_ATTN[:3]]
        if a.qk_norm:
            out += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
    out.append(f"{p}.post_attention_layernorm.weight")
    if not a.moe or i < a.first_dense_layers:
        return out + [f"{p}.mlp.{n}.weight" for n in _MLP]
    out.append(f"{p}.mlp.gate.weight")
    if a.shared_experts:
        out += [f"{p}.mlp.shared_experts.{n}.weight" for n in _MLP]
    for e in range(a.experts):
        out += [f"{p}.mlp.experts.{e}.{n}.weight" for n in _MLP]
    return out


def named_tensors(a: Arch) -> list[tuple[str, Tensor]]:
    """(HF name, model_arch Tensor) of every checkpoint tensor, in export order."""
    out = [("model.embed_tokens.weight", embedding_tensors(a)[0])]
    for i in range(a.layers):
        tensors = layer_tensors(a, i)
        names = _layer_names(a, i)
        if len(names) != len(tensors):
            raise AssertionError(f"{a.name} layer {i}: {len(names)} names for {len(tensors)} tensors")
        out += zip(names, tensors)
    head = head_tensors(a)
    out.append(("model.norm.weight", head[0]))
    if len(head) > 1:
        out.append(("lm_head.weight", head[1]))
    return out
