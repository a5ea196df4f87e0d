"""The megatron flat export at TP=2 on two GPUs, over NCCL (tp_gather.py's batched sends and
receives, the Triton copy table): bench/bench_flat_pp.py on the tiny model, whose stage leader's
flat buckets must give the checksums of its per-tensor export packed, before and after the timed
passes, with every converted copy in the table's launches. The timing command for a 7B model is
in the bench's docstring (and the `flat-pp` recipe: `python -m bench recipe flat-pp`)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_tp2_flat_buckets_over_nccl_are_the_packed_export(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "flat_tp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "bench/bench_flat_pp.py"), "--model", "tiny", "--tp", "2", "--pp", "1", "--reps", "3"]
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = json.loads(out.read_text())["ranks"]
    assert all(r["exact"] and r["exact_after"] for r in ranks), ranks
    lead, other = ranks
    assert lead["buckets"] > 0 and other["buckets"] == 0, ranks
    assert lead["received_bytes"] > 0 and lead["landed_bytes"] > 0, lead  # the vocab shard lands in its slot
    pytest.importorskip("triton")
    assert lead["torch_copies"] == 0 and lead["launches"] >= 1, lead
    print(json.dumps(ranks, indent=1))


def test_tp2_flat_cases_over_nccl(tmp_path):
    """The CPU cases of test_flat_export_tp.py on two GPUs (NCCL, the copy kernel): the stage
    leader's flat buckets (multi-sender) and rank 0's single-sender `flat_buckets` with the other
    rank in its worker loop, byte for byte against the packed export, after a step, new storage and
    a declining rank; every converted copy in the table's launches."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("megatron.core")
    from tests.support.flat_tp_report import check_tp_report, save_tp_models, tp_report

    dirs = save_tp_models(tmp_path / "hf")
    leaders = check_tp_report(tp_report(dirs, tmp_path, 2, ["--tp", "2"]), tp=2, pp=1)
    for (family, case), by_rank in leaders.items():
        r = by_rank["0"]
        assert r["landed_bytes"] > 0 or family == "qwen2", f"{family} {case}: {r}"
        if importlib.util.find_spec("triton") is not None:
            assert r["torch_copies"] == 0 and r["launches"] >= 1, f"{family} {case}: {r}"
