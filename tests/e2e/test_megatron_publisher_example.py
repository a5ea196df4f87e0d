"""examples/publish_from_megatron.py, run exactly as examples/README.md shows (the command is read
from there): two torchrun ranks of a megatron-core PP=2 loop publish every step through a group
Publisher, each stage's rank streaming its own layers to a real rollout-svc with a token, and the
rollout serves bit-exactly the weights the trainer's ranks hold, gathered into HF tensors, twice."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "examples/publish_from_megatron.py"


def readme_command() -> list[str]:
    text = (ROOT / "examples" / "README.md").read_text()
    found = re.findall(rf"`(torchrun [^`]*{re.escape(SCRIPT)}[^`]*)`", text)
    assert len(found) == 1, f"examples/README.md should show one torchrun command for {SCRIPT}: {found}"
    argv = shlex.split(found[0])
    # torchrun is `python -m torch.distributed.run`: the same launcher, from this interpreter
    return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]


def test_a_megatron_loop_publishes_from_every_owner_rank_bit_exactly_twice_with_auth_on():
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        PYTHONWARNINGS="ignore",
    )
    out = subprocess.run(readme_command(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    lines = [
        line for line in out.stdout.splitlines() if re.match(r"(BEFORE|UNEXPECTED|EXACT|MISMATCH|OK|FAILED)", line)
    ]
    # the rollout served its own random weights before the first sync: the equality below means something
    assert lines[0] == "BEFORE version=0", out.stdout
    exact = [
        re.match(r"EXACT step=(\d+) version=(\d+) senders=0,1 bytes=(\d+) max_abs_diff=0\.0$", x) for x in lines[1:3]
    ]
    assert all(exact), out.stdout
    # both pipeline stages streamed their own layers, two versions in a row
    assert [(int(m[1]), int(m[2])) for m in exact] == [(1, 1), (2, 2)]
    assert lines[-1] == "OK", out.stdout
