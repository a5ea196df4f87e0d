"""The megatron trainer's process group listens on loopback only (issue: its TCPStore bound every interface)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]

_PROBE = """
import json, torch.distributed as dist
from trainer_svc.actor.megatron.parallel import init_distributed
from tests.support.listeners import listening
init_distributed()
import torch
t = torch.ones(3)
dist.all_reduce(t)  # the group works
print(json.dumps({"listening": listening(), "sum": t.tolist()}))
"""


def test_single_process_group_binds_no_public_listener():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["sum"] == [1.0, 1.0, 1.0]
    from tests.support.listeners import exposed

    # before the fix: [':::<port>'] — the TCPStore of a tcp:// init method listens on every interface
    assert not exposed(got["listening"]), got["listening"]
