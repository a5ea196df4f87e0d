"""Rule tables and transforms, without megatron-core: pure tensor functions and table checks."""
from __future__ import annotations

import pytest
import torch

from trainer_svc.megatron.rules import Dims, known_families, rules_for
from trainer_svc.megatron.rules.transforms import GATE_UP, QKV

D = Dims(num_layers=2, hidden_size=8, num_heads=6, num_query_groups=2, head_dim=4, ffn_hidden_size=10, vocab_size=16)


def _reference_fused_qkv(q, k, v, d: Dims):
    # an independent spelling of Megatron's layout: for each group g, its q heads, then k_g, then v_g
    rows = []
    for g in range(k.shape[0] // d.head_dim):
        for h in range(g * d.heads_per_group, (g + 1) * d.heads_per_group):
            rows.append(q[h * d.head_dim:(h + 1) * d.head_dim])
        rows.append(k[g * d.head_dim:(g + 1) * d.head_dim])
        rows.append(v[g * d.head_dim:(g + 1) * d.head_dim])
    return torch.cat(rows)


@pytest.mark.parametrize("tail", [(8,), ()], ids=["weight", "bias"])
def test_qkv_matches_per_group_layout_and_inverts(tail):
    q = torch.randn(D.num_heads * D.head_dim, *tail)
    k = torch.randn(D.num_query_groups * D.head_dim, *tail)
    v = torch.randn(D.num_query_groups * D.head_dim, *tail)
    fused = QKV.to_megatron([q, k, v], D)
    assert torch.equal(fused, _reference_fused_qkv(q, k, v, D))
    q2, k2, v2 = QKV.to_hf(fused, D)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_qkv_tp_local_pieces_equal_slices_of_full():
    # what load/export rely on: rank r's shard == fused(chunk r of q, k, v) == rows r of the full fused
    q, k, v = (torch.randn(D.num_heads * D.head_dim, 8), torch.randn(8, 8), torch.randn(8, 8))
    full = QKV.to_megatron([q, k, v], D)
    for r, rows in enumerate(torch.chunk(full, 2)):
        local = QKV.to_megatron([torch.chunk(q, 2)[r], torch.chunk(k, 2)[r], torch.chunk(v, 2)[r]], D)
        assert torch.equal(local, rows)


def test_qkv_wrong_heads_names_the_fields():
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        QKV.to_hf(torch.randn(7, 8), D)
    with pytest.raises(ValueError, match="num_attention_heads=6"):
        QKV.to_megatron([torch.randn(20, 8), torch.randn(8, 8), torch.randn(8, 8)], D)


def test_gate_up_roundtrip():
    gate, up = torch.randn(5, 8), torch.randn(5, 8)
    fused = GATE_UP.to_megatron([gate, up], D)
    assert torch.equal(fused[:5], gate) and torch.equal(fused[5:], up)
    g2, u2 = GATE_UP.to_hf(fused, D)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_unknown_family_is_named():
    with pytest.raises(ValueError, match="'gpt2'"):
        rules_for("gpt2")
    assert {"qwen2", "qwen2-tied", "llama", "qwen3"} <= set(known_families())


def test_unmapped_megatron_tensor_is_named():
    with pytest.raises(ValueError, match="decoder.layers.0.mlp.router.weight"):
        rules_for("qwen2").match("decoder.layers.0.mlp.router.weight")
    rule, layer = rules_for("qwen3").match("decoder.layers.3.self_attention.q_layernorm.weight")
    assert layer == 3 and rule.hf_names(layer) == ["model.layers.3.self_attn.q_norm.weight"]


def test_tables_differ_where_the_families_do():
    names = lambda fam: {h for r in rules_for(fam).rules for h in r.hf}  # noqa: E731
    assert any("q_proj.bias" in n for n in names("qwen2"))
    assert not any("bias" in n for n in names("llama") | names("qwen3"))
    assert any("q_norm" in n for n in names("qwen3"))
    assert "lm_head.weight" in names("qwen2") and "lm_head.weight" not in names("qwen2-tied")


def test_table_checked_against_transformers(make_config):
    from trainer_svc.megatron.hf_meta import export_plan

    # the llama table has no q/k/v bias, the qwen2 model does: the first (sorted) unmapped one is named
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias.*12 unmapped"):
        export_plan(make_config("qwen2"), "llama")
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        export_plan(make_config("qwen2"), "qwen2-tied")


def test_layout_errors_name_the_field(make_config):
    from trainer_svc.megatron.model import check_layout, dims_of
    from trainer_svc.megatron.parallel import Parallelism

    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        dims_of(make_config("qwen2", num_key_value_heads=3))
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by TP=4"):
        check_layout(dims_of(make_config("llama")), Parallelism(tp=4))
    with pytest.raises(ValueError, match="num_hidden_layers=4 is not divisible by PP\\*VPP=6"):
        check_layout(dims_of(make_config("llama")), Parallelism(pp=2, vpp=3))
    with pytest.raises(ValueError, match="vpp=2 needs pp"):
        Parallelism(vpp=2)


def test_export_metas_from_config_only(make_config):
    from trainer_svc.megatron.hf_meta import export_metas

    metas = export_metas(make_config("qwen3"), "qwen3", torch.bfloat16)
    assert metas[0].name == "model.embed_tokens.weight" and metas[0].shape == (250, 64)
    assert metas[-1].name == "lm_head.weight" and all(m.dtype == torch.bfloat16 for m in metas)
    assert [m.name for m in metas if "layers.1." in m.name][0] == "model.layers.1.input_layernorm.weight"
    assert len({m.name for m in metas}) == len(metas)
