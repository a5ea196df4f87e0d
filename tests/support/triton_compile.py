"""Compile Triton kernels for an H100 (sm_90) down to a cubin on a machine without a GPU.

Triton's interpreter, which the CPU tests run kernels through, accepts code the compiler refuses; a
test that compiles them ahead of time catches that without a device. The script runs in a subprocess
with a fresh cache (so it really compiles) and must print "compiled" at its end; skipped where triton
is not installed (CI)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compile_for_sm90(script: str, cache_dir: Path) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (CI)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT)
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-6000:]
