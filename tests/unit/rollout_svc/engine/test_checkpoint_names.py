"""The built-in engine speaks checkpoint names even where transformers fuses tensors in memory
(MoE experts): a saved checkpoint loads tensor by tensor and the engine computes the same logits."""

import glob

import pytest
import torch
from safetensors.torch import load_file

from rollout_svc.engine.builtin import BuiltinEngine
from rollout_svc.engine.checkpoint_names import SplitParam, checkpoint_views
from weightsync.models import resolve_model

IDS = [3, 1, 4, 1, 5, 9]


def _saved(model, tmp_path):
    model.save_pretrained(str(tmp_path))
    sd = {}
    for f in glob.glob(str(tmp_path / "*.safetensors")):
        sd.update(load_file(f))
    return sd


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_moe_checkpoint_loads_expert_by_expert_and_logits_match(name, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = resolve_model(name)[0]
    torch.manual_seed(5)
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    sd = _saved(ref, tmp_path)
    eng = BuiltinEngine.from_config(cfg, seed=1)
    metas = eng.param_metas()
    assert set(metas) == set(sd) and any(".experts.3.down_proj.weight" in n for n in metas)
    assert all(tuple(metas[n].shape) == tuple(t.shape) for n, t in sd.items())
    assert eng.num_parameters() == sum(t.numel() for t in sd.values())
    before = eng.score(IDS, 1)[1]
    # one expert tensor at a time: each lands in its own slice of the fused parameter
    for n, t in sorted(sd.items(), reverse=True):
        eng.load_weights([(n, t)])
    with torch.no_grad():
        want = ref(torch.tensor([IDS])).logits[0, -1]
    got = eng.score(IDS, 1)[1]
    assert not torch.equal(before, got)
    assert torch.equal(want, got), (want - got).abs().max()


def test_a_dense_model_keeps_its_parameters_as_they_are():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(resolve_model("tiny-qwen2")[0])
    views = checkpoint_views(model)
    assert views.keys() == dict(model.named_parameters()).keys()
    assert not any(isinstance(v, SplitParam) for v in views.values())


def test_an_expert_inside_a_fused_parameter_is_not_offered_for_direct_writes():
    # a sync writes received bytes straight into `writable_params`; an expert that lives inside a fused
    # parameter is no storage of its own, so a bucket holding one must go through load_weights
    eng = BuiltinEngine.from_config(resolve_model("tiny-qwen3-moe")[0], seed=1)
    metas = eng.param_metas()
    expert = next(m for n, m in metas.items() if ".experts.3.down_proj.weight" in n)
    dense = next(m for n, m in metas.items() if n.endswith("input_layernorm.weight"))
    assert eng.writable_params([dense, expert]) is None
    (got,) = eng.writable_params([dense])
    assert got.data_ptr() == eng._target(dense.name).data_ptr()
