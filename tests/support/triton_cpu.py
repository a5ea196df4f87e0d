"""Our Triton kernels tested on a machine without a GPU (both skipped where triton is not installed: CI).

- `rerun_under_interpreter`: a test file's other tests again in a subprocess with TRITON_INTERPRET=1,
  which must be on before triton is first imported (triton's own reductions, tl.max among them, are
  decorated then), so a fixture in the test's own process cannot switch it.
- `compile_for_sm90`: Triton's interpreter accepts code the compiler refuses; a script that compiles
  the kernels for an H100 (sm_90) down to a cubin catches that without a device. It runs in a
  subprocess with a fresh cache (so it really compiles) and must print "compiled" at its end."""

from __future__ import annotations

import importlib.util
import os
import re
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


def rerun_under_interpreter(test_file: str, deselect: str, flag_env: str) -> None:
    """Run `test_file`'s tests but those matching `deselect` with TRITON_INTERPRET=1 and `flag_env`=1
    (the file's fixtures then take the kernel path); every one must pass, none be skipped."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (CI): the torch path is what runs here")
    env = {**os.environ, "TRITON_INTERPRET": "1", flag_env: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", f"not {deselect}"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(r"\b(\d+) passed", proc.stdout) and " skipped" not in proc.stdout, proc.stdout[-2000:]
