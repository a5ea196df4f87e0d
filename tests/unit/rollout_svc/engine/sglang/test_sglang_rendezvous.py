"""The trainer side of SGLang's weight-update group, against SGLang's own joining code, on CPU.

SGLang cannot be imported here, but `sglang.srt.utils.common.init_custom_process_group` (what
every SGLang TP rank runs inside `init_weights_update_group`) depends only on torch. We lift
that one function out of the real wheel with `ast` and run it as rank 1 against
`serve_rendezvous` (rank 0) on gloo, then broadcast a bucket the way the flattened-bucket path
does: one uint8 tensor, src=0. NCCL is the production backend; the store keys and rendezvous are
the same code path for both.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from rollout_svc.engine.sglang_api import CHECKED_VERSIONS
from rollout_svc.engine.sglang_weights import UpdateGroup, serve_rendezvous

from .contract import WheelUnavailable, fetch_wheel

# Runs in its own process, as SGLang's scheduler does: rank 1 joins with SGLang's function and
# receives one flat uint8 bucket by broadcast from rank 0.
_MEMBER = r"""
import ast, os, sys, zipfile, torch, torch.distributed as dist
wheel, addr, port, world, rank, name, nbytes = sys.argv[1:8]
tree = ast.parse(zipfile.ZipFile(wheel).read("sglang/srt/utils/common.py"))
fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group")
ns = {"torch": torch, "torch_release": tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])}
exec(compile(ast.Module([fn], []), "sglang:init_custom_process_group", "exec"), ns)
pg = ns["init_custom_process_group"](backend="gloo", init_method=f"tcp://{addr}:{port}", world_size=int(world),
                                     rank=int(rank), group_name=name)
buf = torch.empty(int(nbytes), dtype=torch.uint8)
dist.broadcast(buf, src=0, group=pg)
print("RECEIVED", buf.view(torch.int32).sum().item(), flush=True)
# Under CPU load torch's gloo teardown at interpreter exit sometimes aborts ("terminate called
# without an active exception", even after destroy_process_group), after the bucket arrived.
# Teardown is not what this checks, and SGLang's scheduler never exits this way: leave at once.
os._exit(0)
"""


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("version", CHECKED_VERSIONS)
def test_trainer_serves_sglang_rendezvous_and_broadcasts_a_bucket(version):
    try:
        wheel = fetch_wheel(version)
    except WheelUnavailable as exc:
        pytest.skip(str(exc))
    group = UpdateGroup(
        "127.0.0.1", _free_port(), rank_offset=1, world_size=2, group_name=f"ws-test-{version}", backend="gloo"
    )
    sent = torch.arange(1000, dtype=torch.int32)
    member = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _MEMBER,
            str(wheel),
            group.master_address,
            str(group.master_port),
            str(group.world_size),
            str(group.rank_offset),
            group.group_name,
            str(sent.numel() * 4),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pg = serve_rendezvous(group, timeout_s=60)
        dist.broadcast(sent.view(torch.uint8), src=0, group=pg)
        out, err = member.communicate(timeout=120)
    finally:
        if member.poll() is None:
            member.kill()
    assert member.returncode == 0, out + err[-3000:]
    assert f"RECEIVED {int(sent.sum())}" in out
