"""HF tensor names and shapes of Qwen2.5-shaped models, for synthetic weight-sync benchmarks."""

from __future__ import annotations

CONFIGS = {
    # name: hidden, intermediate, layers, heads, kv heads, vocab, tied
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
    "32b": (5120, 27648, 64, 40, 8, 152064, False),
}


def shapes(name: str, layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    return shapes_of(CONFIGS[name], layers)


def shapes_of(cfg: tuple, layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """`shapes` of a config tuple (CONFIGS' order) that CONFIGS does not name."""
    h, inter, n_layers, heads, kv, vocab, tied = cfg
    n_layers = layers or n_layers
    hd = h // heads
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv * hd, h)),
            (p + "self_attn.k_proj.bias", (kv * hd,)),
            (p + "self_attn.v_proj.weight", (kv * hd, h)),
            (p + "self_attn.v_proj.bias", (kv * hd,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not tied:
        out.append(("lm_head.weight", (vocab, h)))
    return out
