"""MoE (expert parallelism, shared experts, sequential and grouped expert layouts) and MTP layers on
megatron-core (CPU, gloo) against transformers: HF -> Megatron -> HF bit-exact at EP=1 and EP=2 with
TP / PP / VPP, logits parity at PP=1, errors only one EP rank sees, the converter at EP=2.

One 2-rank torchrun launch runs every layout (tearing megatron's parallel state down in between),
to keep CI time small.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.megatron_models import SUPPORT, add_mtp_layers, make_config, save_random_hf, torchrun


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf-moe")
    dirs = {
        "qwen3_moe": save_random_hf(make_config("qwen3_moe"), root / "qwen3_moe", seed=11),
        "qwen2_moe": save_random_hf(make_config("qwen2_moe"), root / "qwen2_moe", seed=12),
        "qwen3_moe-mtp": add_mtp_layers(
            save_random_hf(make_config("qwen3_moe"), root / "qwen3_moe-mtp", seed=13), "deepseek"
        ),
        "qwen2-mtp": add_mtp_layers(save_random_hf(make_config("qwen2"), root / "qwen2-mtp", seed=14), "mimo", depth=2),
        # the grouped layout runs in bf16 only, so its checkpoint is bf16 for a bit-exact round trip
        "qwen2_moe-bf16": save_random_hf(
            make_config("qwen2_moe"), root / "qwen2_moe-bf16", seed=15, dtype=torch.bfloat16
        ),
    }
    return {k: str(v) for k, v in dirs.items()}


@pytest.fixture(scope="module")
def report(moe_dirs, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("moe-run") / "report.json"
    proc = torchrun(SUPPORT / "_dist_moe.py", 2, ["--out", str(out), "--dirs", json.dumps(moe_dirs)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_roundtrip_is_bit_exact_and_logits_match(report):
    cases = {k: v for k, v in report.items() if "/" in k}
    assert len(cases) == 13, sorted(cases)
    for case, res in cases.items():
        assert "error" not in res, f"{case}: {res['error']}"
        assert res["mismatch"] == [] and res["missing"] == [], f"{case}: not bit-exact {res}"
        assert res["metas_match"], f"{case}: export_metas() differs from what export_tensors() yields"
        assert res["saved_exact"], f"{case}: save_hf() wrote different tensors"
        assert res["own_export_ok"], f"{case}: a rank's own export differs from what export_owners() gives it"
        assert res["helper_ok"], f"{case}: hf_tensors() differs from the actor's own export on some rank"
        # one sender per pipeline stage, and with EP=2 (TP=1 or ETP=1) the second EP rank sends its experts
        assert len(res["senders"]) == (2 if case.startswith(("ep2/", "pp2-vpp2/", "tp2-ep2-etp1/")) else 1), (
            case,
            res["senders"],
        )
        if "logits_rel_err" in res:
            # fp32 agrees to rounding; the grouped layout runs in bf16 on both sides
            tol = 2e-2 if case.endswith("/grouped") else 1e-5
            assert res["logits_rel_err"] <= tol, f"{case}: logits rel err {res['logits_rel_err']}"
    assert sum("logits_rel_err" in r for r in cases.values()) == 10


def test_an_error_one_ep_rank_sees_is_raised_on_both(report):
    err = report["errors"]
    missing = err["missing_expert"]
    assert missing["ranks_raised"] == 2, missing
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in missing["message"], missing
    assert "(on rank 1)" in missing["message"] and "EP=2" in missing["message"], missing
    count = err["expert_count"]
    assert (
        count["ranks_raised"] == 2
        and "model.layers.0.mlp.gate.weight" in count["message"]
        and "(4, 64) != expected (8, 64)" in count["message"]
    ), count
    shape = err["expert_shape"]
    assert (
        shape["ranks_raised"] == 2
        and "mlp.experts.0.gate_proj.weight" in shape["message"]
        and "(32, 64) != expected (48, 64)" in shape["message"]
    ), shape


def test_converter_at_ep2_with_mtp(report):
    conv = report["convert"]
    # one file per EP rank: (tp, pp, ep, etp)
    assert conv["files"] == ["mp_rank_00_000_000_000.pt", "mp_rank_00_000_001_000.pt"], conv
    assert conv["exact"], conv
