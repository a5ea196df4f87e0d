"""megatron-core on CPU (gloo) against transformers: HF -> Megatron -> HF bit-exact for every
family at each TP/PP/VPP layout, logits parity at PP=1, the rank-0/worker command protocol, errors.

Every megatron-core process runs in a subprocess (torchrun for multi-rank), so the compat patches
and Megatron's global parallel state never leak into the pytest process. One launch per world size
runs its layouts (the parallel state destroyed between them) and all families.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.megatron_models import FAMILIES, SUPPORT, torchrun

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2)]
# one torchrun launch per world size runs its layouts one after the other: each launch pays megatron's
# imports in every rank (seconds each on a 2-core machine), a layout only its build and checks
LAUNCHES = {n: [lay for lay in LAYOUTS if lay[0] * lay[1] == n] for n in sorted({t * p for t, p, _ in LAYOUTS})}


@pytest.mark.parametrize("nproc", list(LAUNCHES), ids=[f"world{n}" for n in LAUNCHES])
def test_hf_megatron_hf_roundtrip(nproc, hf_dirs, tmp_path):
    out = tmp_path / "report.json"
    layouts = [f"{t},{p},{v}" for t, p, v in LAUNCHES[nproc]]
    proc = torchrun(
        SUPPORT / "_dist_roundtrip.py",
        nproc,
        [*(a for lay in layouts for a in ("--layout", lay)), "--out", str(out), *[str(hf_dirs[f]) for f in FAMILIES]],
        timeout=240 * len(layouts),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    reports = json.loads(out.read_text())
    assert sorted(reports) == sorted(layouts)
    for layout, report in reports.items():
        _check_layout(layout, report)


def _check_layout(layout: str, report: dict) -> None:
    pp = int(layout.split(",")[1])
    assert sorted(report) == sorted(FAMILIES), layout
    for family, res in report.items():
        where = f"{family} at tp,pp,vpp={layout}"
        assert "error" not in res, f"{where}: {res['error']}"
        assert res["mismatch"] == [] and res["missing"] == [], f"{where}: not bit-exact {res}"
        assert res["metas_match"], f"{where}: export_metas() differs from what export_tensors() yields"
        assert res["saved_exact"], f"{where}: save_hf() did not reload bit-exactly in transformers"
        assert res["version"] == 1
        assert res["tied_head_ok"], f"{where}: the last stage's copy of the tied embedding differs"
        # multi-sender: every owner yields exactly its tensors; one sender per pipeline stage
        assert res["own_export_ok"], f"{where}: a rank's own export differs from what export_owners() gives it"
        assert len(res["senders"]) == pp, res["senders"]
        assert res["helper_ok"], f"{where}: hf_tensors() differs from the actor's own export on some rank"
        if pp == 1:
            # the strongest check of the mapping: same weights, same logits (fp32, CPU)
            assert res["logits_rel_err"] <= 1e-5, f"{where}: logits rel err {res['logits_rel_err']}"


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
