"""The megatron flat export at TP=2 on two GPUs, over NCCL (tp_gather.py's batched sends and
receives, the Triton copy table): bench/bench_flat_pp.py on the tiny model, whose stage leader's
flat buckets must give the checksums of its per-tensor export packed, before and after the timed
passes, with every converted copy in the table's launches. The timing command for a 7B model is
in the bench's docstring (and `PART=d bash bench/run_pending_gpu.sh`)."""

from __future__ import annotations

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
