"""Rule tables and transforms, without megatron-core: pure tensor functions and table checks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer_svc.actor.megatron.rules import Dims, Site, known_families, rules_for
from trainer_svc.actor.megatron.rules.transforms import GATE_UP, QKV, SWAP_HALVES

D = Dims(num_layers=2, hidden_size=8, num_heads=6, num_query_groups=2, head_dim=4, ffn_hidden_size=10, vocab_size=16)


def _reference_fused_qkv(q, k, v, d: Dims):
    # an independent spelling of Megatron's layout: for each group g, its q heads, then k_g, then v_g
    rows = []
    for g in range(k.shape[0] // d.head_dim):
        for h in range(g * d.heads_per_group, (g + 1) * d.heads_per_group):
            rows.append(q[h * d.head_dim : (h + 1) * d.head_dim])
        rows.append(k[g * d.head_dim : (g + 1) * d.head_dim])
        rows.append(v[g * d.head_dim : (g + 1) * d.head_dim])
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
    rule, site = rules_for("qwen3").match("decoder.layers.3.self_attention.q_layernorm.weight")
    assert site == Site(layer=3) and rule.hf_names(site) == ["model.layers.3.self_attn.q_norm.weight"]


def test_tables_differ_where_the_families_do():
    names = lambda fam: {h for r in rules_for(fam).rules for h in r.hf}  # noqa: E731
    assert any("q_proj.bias" in n for n in names("qwen2"))
    assert not any("bias" in n for n in names("llama") | names("qwen3"))
    assert any("q_norm" in n for n in names("qwen3"))
    assert "lm_head.weight" in names("qwen2") and "lm_head.weight" not in names("qwen2-tied")


def test_table_checked_against_transformers(make_config):
    from trainer_svc.actor.megatron.hf_meta import build_spec, export_plan

    # the llama table has no q/k/v bias, the qwen2 model does: the first (sorted) unmapped one is named
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias.*12 unmapped"):
        export_plan(build_spec(make_config("qwen2"), family="llama"))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        export_plan(build_spec(make_config("qwen2"), family="qwen2-tied"))


def test_layout_errors_name_the_field(make_config):
    from trainer_svc.actor.megatron.model import check_layout
    from trainer_svc.actor.megatron.parallel import Parallelism
    from weightsync.model_spec import dims_of

    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        dims_of(make_config("qwen2", num_key_value_heads=3))
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by TP=4"):
        check_layout(dims_of(make_config("llama")), Parallelism(tp=4))
    with pytest.raises(ValueError, match="num_hidden_layers=4 is not divisible by PP\\*VPP=6"):
        check_layout(dims_of(make_config("llama")), Parallelism(pp=2, vpp=3))
    with pytest.raises(ValueError, match="vpp=2 needs pp"):
        Parallelism(vpp=2)


def test_export_metas_from_config_only(make_config):
    from trainer_svc.actor.megatron.hf_meta import build_spec, export_metas

    metas = export_metas(build_spec(make_config("qwen3")), torch.bfloat16)
    assert metas[0].name == "model.embed_tokens.weight" and metas[0].shape == (250, 64)
    assert metas[-1].name == "lm_head.weight" and all(m.dtype == torch.bfloat16 for m in metas)
    assert [m.name for m in metas if "layers.1." in m.name][0] == "model.layers.1.input_layernorm.weight"
    assert len({m.name for m in metas}) == len(metas)


# ---- MoE, MTP, expert layouts -----------------------------------------------------------------
MOE_D = Dims(
    num_layers=3,
    hidden_size=8,
    num_heads=2,
    num_query_groups=1,
    head_dim=4,
    ffn_hidden_size=10,
    vocab_size=16,
    num_experts=2,
    moe_ffn_hidden_size=6,
    moe_layers=(True, False, True),
)


def test_moe_table_expands_experts_only_on_moe_layers():
    order = [(r.hf_names(s, MOE_D.num_layers), s) for r, s in rules_for("qwen2_moe").ordered(MOE_D)]
    names = [n for ns, _ in order for n in ns]
    assert "model.layers.0.mlp.experts.1.down_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" not in names  # layer 0 is MoE: no dense MLP
    assert "model.layers.1.mlp.gate_proj.weight" in names  # layer 1 is dense
    assert not any(n.startswith("model.layers.1.mlp.experts") or n == "model.layers.1.mlp.gate.weight" for n in names)
    layer0 = [n for n in names if n.startswith("model.layers.0.mlp.")]
    assert layer0 == [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.experts.0.up_proj.weight",
        "model.layers.0.mlp.experts.1.gate_proj.weight",
        "model.layers.0.mlp.experts.1.up_proj.weight",
        "model.layers.0.mlp.experts.0.down_proj.weight",
        "model.layers.0.mlp.experts.1.down_proj.weight",
        "model.layers.0.mlp.shared_expert.gate_proj.weight",
        "model.layers.0.mlp.shared_expert.up_proj.weight",
        "model.layers.0.mlp.shared_expert.down_proj.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
    ]
    assert len(names) == len(set(names))


def test_expert_names_match_back_to_global_expert_and_layer():
    table = rules_for("qwen3_moe")
    rule, site = table.match("decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight")
    assert site == Site(layer=2, expert=1) and rule.expert and rule.tp_dim == 0
    assert rule.hf_names(site) == [
        "model.layers.2.mlp.experts.1.gate_proj.weight",
        "model.layers.2.mlp.experts.1.up_proj.weight",
    ]
    rule, site = table.match("decoder.layers.0.mlp.router.weight")
    assert not rule.expert and rule.tp_dim is None and rule.hf_names(site) == ["model.layers.0.mlp.gate.weight"]
    with pytest.raises(ValueError, match="shared_experts"):
        table.match("decoder.layers.0.mlp.shared_experts.linear_fc1.weight")  # qwen3_moe has none


def _mtp_names(family: str, style: str, d: Dims) -> list[str]:
    return [n for r, s in rules_for(family, mtp=style).ordered(d) if r.per_mtp for n in r.hf_names(s, d.num_layers)]


def test_deepseek_mtp_names_follow_the_decoder_and_copy_embedding_and_head():
    d = Dims(
        num_layers=3,
        hidden_size=8,
        num_heads=2,
        num_query_groups=1,
        head_dim=4,
        ffn_hidden_size=10,
        vocab_size=16,
        mtp_layers=2,
    )
    names = _mtp_names("qwen3", "deepseek", d)
    assert names[:3] == ["model.layers.3.enorm.weight", "model.layers.3.hnorm.weight", "model.layers.3.eh_proj.weight"]
    assert "model.layers.3.self_attn.q_norm.weight" in names and "model.layers.4.mlp.down_proj.weight" in names
    assert names[len(names) // 2 - 3 : len(names) // 2] == [
        "model.layers.3.shared_head.norm.weight",
        "model.layers.3.embed_tokens.weight",
        "model.layers.3.shared_head.head.weight",
    ]
    table = rules_for("qwen3", mtp="deepseek")
    # the copies are exported, never loaded: the embedding loads from model.embed_tokens.weight
    rule, _ = table.match("embedding.word_embeddings.weight")
    assert rule.hf == ("model.embed_tokens.weight",)
    rule, site = table.match("mtp.layers.1.transformer_layer.self_attention.linear_qkv.weight")
    assert rule.hf_names(site, 3)[0] == "model.layers.4.self_attn.q_proj.weight"
    tied = _mtp_names("qwen3-tied", "deepseek", d)
    assert "model.layers.3.shared_head.head.weight" in tied
    assert [
        r.megatron
        for r in rules_for("qwen3-tied", mtp="deepseek").rules
        if r.hf == ("model.layers.{mtp_layer}.shared_head.head.weight",)
    ] == ["embedding.word_embeddings.weight"]


def test_mimo_mtp_names_and_mtp_layer_shaped_like_the_last_decoder_layer():
    names = _mtp_names(
        "qwen2",
        "mimo",
        Dims(
            num_layers=3,
            hidden_size=8,
            num_heads=2,
            num_query_groups=1,
            head_dim=4,
            ffn_hidden_size=10,
            vocab_size=16,
            mtp_layers=1,
        ),
    )
    assert names[:3] == [
        "model.mtp_layers.0.token_layernorm.weight",
        "model.mtp_layers.0.hidden_layernorm.weight",
        "model.mtp_layers.0.input_proj.weight",
    ]
    assert names[-1] == "model.mtp_layers.0.final_layernorm.weight"
    assert "model.mtp_layers.0.self_attn.q_proj.bias" in names
    # MoE model whose last layer is MoE: its MTP layer has experts (as megatron builds it)
    moe = _mtp_names("qwen3_moe", "deepseek", replace(MOE_D, mtp_layers=1))
    assert "model.layers.3.mlp.experts.1.up_proj.weight" in moe and "model.layers.3.mlp.gate_proj.weight" not in moe
    with pytest.raises(ValueError, match="mtp='medusa'"):
        rules_for("qwen2", mtp="medusa")


def test_swap_halves_reorders_embedding_and_hidden_columns_per_tp_shard():
    w = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)  # [hidden=... rows, 2*3 columns]
    (mimo,) = SWAP_HALVES.to_hf(w, D)
    assert torch.equal(mimo[:, :3], w[:, 3:]) and torch.equal(mimo[:, 3:], w[:, :3])
    assert torch.equal(SWAP_HALVES.to_megatron([mimo], D), w)
    # a row shard converts to the matching rows of the full conversion
    assert torch.equal(SWAP_HALVES.to_hf(w[2:], D)[0], mimo[2:])


def test_grouped_expert_views_follow_grouped_mlp_math_and_write_through():
    from trainer_svc.actor.megatron.param_names import grouped_expert_views

    experts, hidden, ffn = 3, 4, 5
    weight1 = torch.randn(hidden, experts * 2 * ffn)
    weight2 = torch.randn(experts * ffn, hidden)
    x = torch.randn(7, hidden)
    views = grouped_expert_views(weight1, weight2, experts, hidden)
    for e, (fc1, fc2) in enumerate(views):
        assert fc1.shape == (2 * ffn, hidden) and fc2.shape == (hidden, ffn)
        # megatron GroupedMLP.forward: x @ weight1.view(E, h, -1)[e], GLU over [gate | up], @ weight2.view(E, -1, h)[e]
        h1 = x @ weight1.view(experts, hidden, -1)[e]
        gate, up = torch.chunk(h1, 2, dim=-1)
        want = (torch.nn.functional.silu(gate) * up) @ weight2.view(experts, -1, hidden)[e]
        # the same expert as a SequentialMLP expert: linear_fc1 rows [gate; up], linear_fc2
        g, u = torch.chunk(x @ fc1.t(), 2, dim=-1)
        assert torch.allclose((torch.nn.functional.silu(g) * u) @ fc2.t(), want, atol=1e-5)
    views[1][0].copy_(torch.zeros(2 * ffn, hidden))
    assert (weight1.view(experts, hidden, -1)[1] == 0).all() and (weight1.view(experts, hidden, -1)[0] != 0).any()
    with pytest.raises(ValueError, match="hidden_size=3"):
        grouped_expert_views(weight1, weight2, experts, 3)


def test_every_expert_layout_gets_the_same_global_names():
    from torch import nn

    from trainer_svc.actor.megatron.param_names import named_parameters_global

    class Layer(nn.Module):
        def __init__(self, number, experts):
            super().__init__()
            self.layer_number = number
            self.mlp = nn.Module()
            self.mlp.local_expert_indices = [2, 3]  # EP rank 1 of 2, 2 experts each
            self.mlp.experts = experts

    def te_experts():  # TEGroupedMLP names its per-expert weights linear_fcN.weight{i}
        e = nn.Module()
        e.linear_fc1, e.linear_fc2 = nn.Module(), nn.Module()
        for i in range(2):
            e.linear_fc1.register_parameter(f"weight{i}", nn.Parameter(torch.full((6, 4), float(i))))
            e.linear_fc2.register_parameter(f"weight{i}", nn.Parameter(torch.full((4, 3), float(i))))
        return e

    chunk = nn.Module()
    chunk.decoder = nn.Module()
    chunk.decoder.layers = nn.ModuleList([Layer(5, te_experts())])  # global layer 4
    names = named_parameters_global([chunk])
    assert sorted(names) == [
        f"decoder.layers.4.mlp.experts.local_experts.{e}.linear_fc{k}.weight" for e in (2, 3) for k in (1, 2)
    ]
    assert (names["decoder.layers.4.mlp.experts.local_experts.3.linear_fc1.weight"] == 1).all()


def test_moe_and_mtp_shapes_come_from_the_checkpoint_layout(make_config):
    from trainer_svc.actor.megatron.hf_meta import build_spec, export_metas

    cfg = make_config("qwen3_moe", num_nextn_predict_layers=1)
    shapes = build_spec(cfg, mtp="deepseek").hf_shapes
    # on-disk per-expert names (transformers 5 fuses them in memory as experts.gate_up_proj)
    assert shapes["model.layers.0.mlp.experts.3.gate_proj.weight"] == (32, 64)
    assert shapes["model.layers.0.mlp.experts.3.down_proj.weight"] == (64, 32)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in shapes
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (128, 64)  # mlp_only_layers=[1]
    assert shapes["model.layers.4.eh_proj.weight"] == (64, 128)
    assert shapes["model.layers.4.mlp.experts.0.up_proj.weight"] == (32, 64)  # last layer (3) is MoE
    assert shapes["model.layers.4.shared_head.head.weight"] == (250, 64)
    metas = export_metas(build_spec(cfg, mtp="deepseek"), torch.bfloat16)
    assert {m.name for m in metas} == set(shapes) and len(metas) == len(shapes)
    assert len(export_metas(build_spec(cfg), torch.bfloat16)) == len(shapes) - len(
        [n for n in shapes if n.startswith("model.layers.4.")]
    )


def test_moe_config_errors_name_the_field(make_config):
    from trainer_svc.actor.megatron.hf_meta import build_spec, export_plan
    from trainer_svc.actor.megatron.model import check_layout
    from trainer_svc.actor.megatron.parallel import Parallelism
    from weightsync.model_spec import dims_of, mtp_depth

    d = dims_of(make_config("qwen3_moe"))
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by EP=3"):
        check_layout(d, Parallelism(ep=3))
    with pytest.raises(ValueError, match="moe_intermediate_size=32 is not divisible by expert TP=3"):
        check_layout(d, Parallelism(tp=2, etp=3))
    with pytest.raises(ValueError, match="EP=2 needs a mixture-of-experts model"):
        check_layout(dims_of(make_config("qwen2")), Parallelism(ep=2))
    with pytest.raises(ValueError, match="no num_nextn_predict_layers"):
        mtp_depth(make_config("qwen3_moe"), "deepseek")
    # a dense table on a MoE checkpoint: the first (sorted) unmapped expert tensor is named
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight.*unmapped"):
        export_plan(build_spec(make_config("qwen2_moe"), family="qwen2"))
