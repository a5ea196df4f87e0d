"""`python -m bench fp8_slots` runs end to end on a tiny model, checks its kernels against the torch paths and
writes the one result schema (its GPU run: tests/gpu/test_fp8_slots_gpu.py, and the `kernels` recipe)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.common.results import validate

ROOT = Path(__file__).resolve().parents[3]


def test_bench_fp8_slots_times_every_step_and_checks_the_bytes(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "fp8_slots",
            "--shape",
            "tiny",
            "--reps",
            "1",
            "--torch",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    (out,) = tmp_path.glob("fp8_slots_cpu_*.json")
    rec = json.loads(out.read_text())
    validate(rec)
    assert rec["bench"] == "fp8_slots" and rec["command"].startswith("python -m bench fp8_slots --shape tiny")
    assert rec["kernels"] == "torch" and rec["quant_matches_torch"] and rec["dequant_matches_torch"], rec
    steps = {r["step"]: r for r in rec["rows"]}
    assert set(steps) == {
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
    for name, r in steps.items():
        assert r["median_s"] > 0 and r["bytes_moved"] > 0 and r["gbps"] > 0, (name, r)
        assert r["copy_gbps"] == steps["copy"]["gbps"], (name, r)  # the baseline of the same run, on each row
    # the tiny Qwen2: every linear weight is FP8, about half the bf16 model's bytes
    assert 0 < rec["fp8_bytes"] < rec["bucket_bytes"] and rec["scale_bytes"] > 0, rec
    assert "quant" in proc.stdout and "GB/s" in proc.stdout
