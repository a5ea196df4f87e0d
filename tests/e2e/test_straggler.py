"""Issue 37: one SIGSTOPped rollout among three does not hold a Sync.

Real trainer-svc and rollout-svc processes on loopback. The stopped rollout's kernel still accepts
and buffers what the trainer sends; only its silence on the sync link (no answer, no liveness beat)
tells it is gone. The other two commit, the stopped one is reported failed, and after SIGCONT its
next registration's catch-up brings it to the trainer's version with the same logits as the others.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

import torch
from reliability_helpers import load, make_model_dirs, rstub, score, status, sync_rpc, tstub, wait_for

from weightsync.local.procs import free_port
from weightsync.v1 import trainer_pb2

LIVENESS_S = 1.0
RPC_TIMEOUT_S = 30.0


def test_a_stopped_rollout_does_not_hold_the_others_and_is_caught_up_after_sigcont(procs, tmp_path):
    cfg_dir, sets = make_model_dirs(tmp_path / "models", [11, 12])
    taddr = f"127.0.0.1:{free_port()}"
    rollouts = [
        procs.rollout(
            "--model",
            str(cfg_dir),
            "--init-seed",
            "7",
            "--trainer-address",
            taddr,
            "--heartbeat-s",
            "1",
            name=f"r{i}",
            grpc_port=free_port(),
        )
        for i in range(3)
    ]
    for r in rollouts:
        r.wait_ready()
    trainer = procs.trainer(
        "--model",
        str(sets[0]),
        "--bucket-mb",
        "1",
        "--grpc-address",
        taddr,
        "--rpc-timeout-s",
        str(RPC_TIMEOUT_S),
        "--liveness-timeout-s",
        str(LIVENESS_S),
        backend="hf",
    )
    trainer.wait_ready()
    for r in rollouts:
        wait_for(lambda r=r: status(rstub(r)).version == 1, 60, f"{r.name} catch-up to v1")

    # normal syncs (the first of each pairing goes over gRPC and opens the sync links)
    normal = []
    for k in range(4):
        load(taddr, sets[(k + 1) % 2])
        t0 = time.monotonic()
        rep = sync_rpc(taddr)
        normal.append(time.monotonic() - t0)
        assert rep.ok, rep
        print(f"\nnormal sync {normal[-1]:.3f}s: phases {dict(rep.phase_seconds)}")
    normal_s = statistics.median(normal[1:])  # this run's normal sync time, on this machine

    stopped = rollouts[2]
    os.kill(stopped.popen.pid, signal.SIGSTOP)
    try:
        took = []
        for k in range(3):
            v = load(taddr, sets[k % 2])
            t0 = time.monotonic()
            rep = tstub(taddr).Sync(trainer_pb2.SyncRequest(), timeout=4 * RPC_TIMEOUT_S).report
            took.append(time.monotonic() - t0)
            by_id = {x.rollout_id: x for x in rep.rollouts}
            healthy = [status(rstub(r)) for r in rollouts[:2]]
            failed = [x for x in rep.rollouts if not x.ok]
            print(f"with one stopped {took[-1]:.3f}s: phases {dict(rep.phase_seconds)}; failed: {failed}")
            assert len(failed) == 1 and failed[0].rollout_id == stopped.name and "silent" in failed[0].error, rep
            assert all(by_id[s.rollout_id].ok and s.version == v for s in healthy), rep
        stopped_s = statistics.median(took)
        print(f"normal {normal_s:.3f}s, with one stopped {stopped_s:.3f}s (medians): {stopped_s / normal_s:.2f}x")
        # the healthy two commit within twice their normal sync time: the silent one is dropped a short
        # grace after they answered its prepare, long before liveness_timeout_s (let alone rpc_timeout_s)
        assert stopped_s < 2 * normal_s, (took, normal)
    finally:
        os.kill(stopped.popen.pid, signal.SIGCONT)

    # back: its heartbeat re-registers it behind, and the catch-up sync brings it to v exactly
    wait_for(lambda: status(rstub(stopped)).version == v, 60, "the stopped rollout caught up")
    assert torch.equal(score(rstub(stopped))[0], score(rstub(rollouts[0]))[0])
