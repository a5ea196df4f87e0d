"""The dense decoder-only (Llama-style) table that qwen2 / llama / qwen3 are variations of."""

from __future__ import annotations

from trainer_svc.actor.megatron.rules.base import DENSE, Rule
from trainer_svc.actor.megatron.rules.transforms import GATE_UP, IDENTITY, QKV

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."


def dense_rules(*, qkv_bias: bool, qk_norm: bool, tied: bool) -> tuple[Rule, ...]:
    attn = H + "self_attn."
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), IDENTITY, tp_dim=0, vocab=True),
        Rule(L + "input_layernorm.weight", (H + "input_layernorm.weight",), IDENTITY),
        Rule(
            L + "self_attention.linear_qkv.weight",
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            QKV,
            tp_dim=0,
        ),
    ]
    if qkv_bias:
        rules.append(
            Rule(
                L + "self_attention.linear_qkv.bias",
                (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                QKV,
                tp_dim=0,
            )
        )
    if qk_norm:
        # per-head RMSNorm over head_dim, replicated on every TP rank
        rules += [
            Rule(L + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), IDENTITY),
            Rule(L + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), IDENTITY),
        ]
    rules += [
        Rule(L + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), IDENTITY, tp_dim=1),
        Rule(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",), IDENTITY),
        # a MoE family's dense layers (mlp_only_layers, decoder_sparse_step) keep these too
        Rule(
            L + "mlp.linear_fc1.weight",
            (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"),
            GATE_UP,
            tp_dim=0,
            layers=DENSE,
        ),
        Rule(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), IDENTITY, tp_dim=1, layers=DENSE),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",), IDENTITY),
    ]
    if not tied:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), IDENTITY, tp_dim=0, vocab=True))
    return tuple(rules)
