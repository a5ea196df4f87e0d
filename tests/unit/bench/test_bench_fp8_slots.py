"""bench/bench_fp8_slots.py runs end to end on a tiny model and checks its kernels against the torch
paths (its GPU run: tests/gpu/test_fp8_slots_gpu.py, and the command in docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_bench_fp8_slots_times_every_step_and_checks_the_bytes(tmp_path):
    out = tmp_path / "quantize_slots.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_fp8_slots.py"), "--shape", "tiny", "--reps", "1", "--torch"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    rec = json.loads(out.read_text())
    assert rec["kernels"] == "torch" and rec["quant_matches_torch"] and rec["dequant_matches_torch"], rec
    assert set(rec["steps"]) == {
        "quant",
        "quant_nosums",
        "copies",
        "refresh",
        "checksum",
        "checksum_rest",
        "dequant",
        "copy",
        "fused_write",
        "trainer_writes",
    }
    assert rec["known_sums_match"] and rec["trainer_writes_matches"], rec
    for name, r in rec["steps"].items():
        assert r["s"] > 0 and r["bytes_moved"] > 0 and r["gbps"] > 0, (name, r)
    # the tiny Qwen2: every linear weight is FP8, about half the bf16 model's bytes
    assert 0 < rec["fp8_bytes"] < rec["bucket_bytes"] and rec["scale_bytes"] > 0, rec
    assert "quant" in proc.stdout and "GB/s" in proc.stdout
