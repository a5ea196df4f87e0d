"""megatron-core on CPU (gloo) against transformers: HF -> Megatron -> HF bit-exact for every
family at each TP/PP/VPP layout, logits parity at PP=1, the rank-0/worker command protocol, errors.

Every megatron-core process runs in a subprocess (torchrun for multi-rank), so the compat patches
and Megatron's global parallel state never leak into the pytest process. One launch per layout
runs all families.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.megatron_models import FAMILIES, SUPPORT, torchrun

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2)]


@pytest.mark.parametrize("tp,pp,vpp", LAYOUTS, ids=[f"tp{t}-pp{p}-vpp{v}" for t, p, v in LAYOUTS])
def test_hf_megatron_hf_roundtrip(tp, pp, vpp, hf_dirs, tmp_path):
    out = tmp_path / "report.json"
    proc = torchrun(
        SUPPORT / "_dist_roundtrip.py",
        tp * pp,
        ["--tp", str(tp), "--pp", str(pp), "--vpp", str(vpp), "--out", str(out), *[str(hf_dirs[f]) for f in FAMILIES]],
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(FAMILIES)
    for family, res in report.items():
        assert "error" not in res, f"{family}: {res['error']}"
        assert res["mismatch"] == [] and res["missing"] == [], f"{family}: not bit-exact {res}"
        assert res["metas_match"], f"{family}: export_metas() differs from what export_tensors() yields"
        assert res["saved_exact"], f"{family}: save_hf() did not reload bit-exactly in transformers"
        assert res["version"] == 1
        assert res["tied_head_ok"], f"{family}: the last stage's copy of the tied embedding differs"
        # multi-sender: every owner yields exactly its tensors; one sender per pipeline stage
        assert res["own_export_ok"], f"{family}: a rank's own export differs from what export_owners() gives it"
        assert len(res["senders"]) == pp, res["senders"]
        assert res["helper_ok"], f"{family}: hf_tensors() differs from the actor's own export on some rank"
        if pp == 1:
            # the strongest check of the mapping: same weights, same logits (fp32, CPU)
            assert res["logits_rel_err"] <= 1e-5, f"{family}: logits rel err {res['logits_rel_err']}"


def test_single_rank_errors_versions_seed_backward(hf_dirs, tmp_path):
    import shutil
    import subprocess

    shutil.copytree(hf_dirs["qwen2"], tmp_path / "qwen2")
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "_single_rank_cases.py"), str(tmp_path), str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    rep = json.loads(out.read_text())
    assert "error" not in rep, rep["error"]
    assert rep["seeded_equal"] and rep["seed_changes_weights"]
    assert rep["version_bump"] == [1, 2]
    assert (
        "model.layers.1.mlp.up_proj.weight" in rep["missing"]
        and "(128, 64)" in rep["missing"]
        and "TP=1" in rep["missing"]
    ), rep["missing"]
    assert (
        "model.layers.0.mlp.gate_proj.weight" in rep["shape"]
        and "(96, 64)" in rep["shape"]
        and "(128, 64)" in rep["shape"]
        and "TP=1" in rep["shape"]
    ), rep["shape"]
    assert "hidden_act='gelu'" in rep["act"], rep["act"]
    assert "no *.safetensors" in rep["empty_dir"], rep["empty_dir"]
    assert rep["llama3_rope_rel_err"] <= 1e-5, rep["llama3_rope_rel_err"]
    assert "rope_type='yarn'" in rep["rope_type"], rep["rope_type"]
    assert rep["backward"]
