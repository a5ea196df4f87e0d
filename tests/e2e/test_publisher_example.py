"""examples/publish_from_own_loop.py, run as a user runs it: an external training loop publishes every
step through weightsync.publisher.Publisher to a real rollout-svc process with a token, and the
rollout serves bit-exactly the published weights, version after version."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_external_loop_publishes_every_step_bit_exactly_with_auth_on():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run(
        [sys.executable, "examples/publish_from_own_loop.py", "--steps", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    # the rollout served other weights before the first sync, so the equality below means something
    assert lines[0].startswith("BEFORE version=0 differs=True"), out.stdout
    exact = [re.match(r"EXACT step=(\d+) version=(\d+) .* max_abs_diff=0\.0$", line) for line in lines[1:4]]
    assert all(exact), out.stdout
    assert [(int(m[1]), int(m[2])) for m in exact] == [(1, 1), (2, 2), (3, 3)]
    assert lines[-1] == "OK", out.stdout
