"""TE-spec Megatron state dicts through the local-spec rule tables, exactly, and mbridge's tables
(which are written for the TE spec) agreeing on every TE name."""

from __future__ import annotations

import pytest
import torch

from tests.support.megatron_models import FAMILIES, MOE_FAMILIES, TINY
from trainer_svc.actor.megatron.hf_meta import build_spec, export_plan
from trainer_svc.actor.megatron.rules import rules_for
from trainer_svc.actor.megatron.rules.te_spec import local_state_dict, spec_of, to_local, to_te

CASES = ["qwen2", "llama", "qwen3", "qwen2-tied", "qwen3_moe", "qwen2_moe"]


def _config(family: str):
    from transformers import AutoConfig

    kw = dict(TINY, **(FAMILIES.get(family) or MOE_FAMILIES[family]))
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def _te_state(family: str):
    """(HF tensors, the same weights as a TE-spec Megatron state dict at TP=1, dims)."""
    config = _config(family)
    spec = build_spec(config)
    assert spec.family == family
    dims, shapes = spec.dims, spec.hf_shapes
    g = torch.Generator().manual_seed(len(family))
    hf = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    te = {}
    for rule, site, names in export_plan(spec):
        if rule.export_only:
            continue
        name = to_te(rule.megatron_name(site), dims)
        te[name] = rule.transform.to_megatron([hf[n] for n in names], dims)
        if name.endswith(".weight") and ".linear_" in name:  # TE modules keep FP8 metadata beside weights
            te[name.rsplit(".", 1)[0] + "._extra_state"] = torch.empty(0, dtype=torch.uint8)
    if getattr(config, "tie_word_embeddings", False):
        hf.pop("lm_head.weight", None)
    return hf, te, dims, config


@pytest.mark.parametrize("family", CASES)
def test_te_named_state_dict_round_trips_exactly_through_the_rule_tables(family):
    hf, te, dims, _ = _te_state(family)
    assert spec_of(te) == "te"
    # spelled as megatron-core's TE layer spec names them
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.input_layernorm.weight" not in te
    if "moe" in family:
        # a MoE layer keeps its own pre-MLP norm (TENorm); TEGroupedMLP numbers experts in the name
        assert "decoder.layers.0.pre_mlp_layernorm.weight" in te
        assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in te
    if family == "qwen3_moe":  # mlp_only_layers=[1]: a dense layer fuses it into linear_fc1
        assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    if "moe" not in family:
        assert "decoder.layers.3.mlp.linear_fc1.layer_norm_weight" in te
    local = local_state_dict(te)
    assert spec_of(local) == "local" and not any("_extra_state" in n for n in local)
    table = rules_for(family)
    back = {}
    for name, t in local.items():
        rule, site = table.match(name)
        for n, piece in zip(rule.hf_names(site, dims.num_layers), rule.transform.to_hf(t, dims)):
            back[n] = piece
    assert sorted(back) == sorted(hf)
    for n in hf:
        assert torch.equal(back[n], hf[n]), n
    # and the reverse spelling: every local name goes to TE and back unchanged
    assert all(to_local(to_te(n, dims)) == n for n in local)


@pytest.mark.parametrize("family", CASES)
def test_mbridge_maps_every_te_name_to_the_same_hf_tensors(family):
    from mbridge.core.bridge import _MODEL_REGISTRY

    _, te, dims, config = _te_state(family)
    bridge = object.__new__(_MODEL_REGISTRY[config.model_type])  # its name tables only; no model is built
    table = rules_for(family)
    unmapped = []
    for name in te:
        if name.endswith("_extra_state"):
            continue
        rule, site = table.match(to_local(name))
        try:
            got = bridge._weight_name_mapping_mcore_to_hf(name)
        except NotImplementedError:
            unmapped.append(name)
            continue
        assert got == rule.hf_names(site, dims.num_layers), name
    # mbridge 0.15.1's MoE tables have no names for a MoE model's dense layers (mlp_only_layers);
    # that layer's MLP is the only thing it cannot map
    want = (
        {
            "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
            "decoder.layers.1.mlp.linear_fc1.weight",
            "decoder.layers.1.mlp.linear_fc2.weight",
        }
        if family == "qwen3_moe"
        else set()
    )
    assert set(unmapped) == want


def test_a_state_dict_with_both_spellings_is_refused_by_name():
    state = {
        "decoder.layers.0.input_layernorm.weight": 1,
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": 2,
    }
    with pytest.raises(
        ValueError,
        match="both 'decoder.layers.0.input_layernorm.weight' and "
        "'decoder.layers.0.self_attention.linear_qkv.layer_norm_weight'",
    ):
        local_state_dict(state)


@pytest.mark.parametrize("family", CASES)
def test_the_rule_table_matches_te_names_as_their_local_parameter(family):
    spec = build_spec(_config(family))
    table = rules_for(spec.family, mtp=spec.mtp)
    for rule, site, _ in export_plan(spec):
        if rule.export_only:
            continue
        local = rule.megatron_name(site)
        assert table.match(to_te(local, spec.dims)) == table.match(local) == (rule, site)
    with pytest.raises(ValueError, match="_extra_state` holds no weights"):
        table.match("decoder.layers.0.self_attention.linear_qkv._extra_state")


def _te_named_model(chunks):
    """Give a local-spec model the TE spec's parameter names: each fused norm's weight moves onto the
    linear layer TE fuses it into (as TELayerNormColumnParallelLinear holds it), a MoE layer's
    pre-MLP norm stays. Only names change (load and export never run the forward)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for chunk in chunks:
        for layer in chunk.decoder.layers:
            fused = [(layer.input_layernorm, layer.self_attention.linear_qkv)]
            if not isinstance(layer.mlp, MoELayer):
                fused.append((layer.pre_mlp_layernorm, layer.mlp.linear_fc1))
            for norm, linear in fused:
                linear.register_parameter("layer_norm_weight", norm._parameters.pop("weight"))
    names = {n for c in chunks for n, _ in c.named_parameters()}
    assert any(n.endswith("linear_qkv.layer_norm_weight") for n in names)
    assert not any(n.endswith("input_layernorm.weight") for n in names)
    return chunks


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "qwen3_moe"])
def test_a_te_named_model_loads_and_exports_hf_exactly(family, tmp_path):
    """The load and export paths on a model whose parameters carry TE-spec names (single rank)."""
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from tests.support.megatron_models import make_config, save_random_hf
    from trainer_svc.actor.megatron.actor import MegatronActor

    hf_dir = save_random_hf(make_config(family), tmp_path / family, seed=3)
    actor = MegatronActor(make_config(family), seed=11)
    _te_named_model(actor.model)
    actor.load_hf(str(hf_dir))
    want = load_file(str(hf_dir / "model.safetensors"))
    got = dict(actor.export_tensors())
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert [(m.name, tuple(m.shape)) for m in actor.export_metas()] == [(n, tuple(t.shape)) for n, t in got.items()]
