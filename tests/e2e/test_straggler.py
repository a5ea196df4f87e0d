"""Issue 37: one SIGSTOPped rollout among three does not hold a Sync.

Real trainer-svc and rollout-svc processes on loopback. The stopped rollout's kernel still accepts
and buffers what the trainer sends; only its silence on the sync link (no answer, no liveness beat)
tells it is gone. The other two commit, the stopped one is reported failed, and after SIGCONT its
next registration's catch-up brings it to the trainer's version with the same logits as the others.

Stopped before a sync (silent at prepare), and stopped mid-stream: there every rollout's bus
connection passes through a BusProxy that paces it (the stream lasts seconds however fast the box is)
and stops the rollout from the proxy's hook once an eighth of the stream went through, so the stop
lands mid-stream by construction, not by timing. The same hook stalls that proxy (a hung host: its
kernel takes nothing more), and the model is several times the kernels' socket buffers, so the
trainer's sends to it block: the others commit on time only because it is dropped from the stream.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

import pytest
import torch
from reliability_helpers import load, make_model_dirs, rstub, score, status, sync_rpc, wait_for

from tests.support.bus_proxy import BusProxy
from weightsync.local.procs import free_port

# the others' sync time against a median of this run's normal syncs (tests/conftest.py)
pytestmark = pytest.mark.serial

LIVENESS_S = 1.0
RPC_TIMEOUT_S = 30.0
#: how long the paced stream of a normal sync lasts in the mid-stream case
STREAM_S = 3.0


def test_a_stopped_rollout_does_not_hold_the_others_and_is_caught_up_after_sigcont(procs, tmp_path):
    taddr, rollouts, sets = _fleet(procs, tmp_path)

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
            rep = sync_rpc(taddr, timeout=4 * RPC_TIMEOUT_S)
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


def _fleet(procs, tmp_path, proxies=None, **model):
    """Three rollouts (rollout i's bus connection through proxies[i] where given) and a trainer, all at v1;
    `model` overrides the test model's config."""
    cfg_dir, sets = make_model_dirs(tmp_path / "models", [11, 12], **model)
    taddr = f"127.0.0.1:{free_port()}"
    rollouts = []
    for i in range(3):
        args = ["--model", str(cfg_dir), "--init-seed", "7", "--trainer-address", taddr, "--heartbeat-s", "1"]
        if proxies and i in proxies:  # listens on 127.0.0.1 at the proxy's port, advertises the proxy's host
            host, dport = proxies[i].sock.getsockname()
            args += ["--data-address", f"127.0.0.1:{dport}", "--advertise-data-host", host]
        rollouts.append(procs.rollout(*args, name=f"r{i}", grpc_port=free_port()))
    for r in rollouts:
        r.wait_ready()
    trainer = procs.trainer(
        *("--model", str(sets[0]), "--bucket-mb", "1", "--grpc-address", taddr),
        *("--rpc-timeout-s", str(RPC_TIMEOUT_S), "--liveness-timeout-s", str(LIVENESS_S)),
        backend="hf",
    )
    trainer.wait_ready()
    for r in rollouts:
        wait_for(lambda r=r: status(rstub(r)).version == 1, 60, f"{r.name} catch-up to v1")
    return taddr, rollouts, sets


def test_a_rollout_stopped_mid_stream_is_dropped_the_others_commit_on_time_and_it_catches_up_exact(
    procs, tmp_path, request
):
    proxies = {}
    for i in range(3):
        dport = free_port()
        proxies[i] = BusProxy(f"127.0.0.{2 + i}", dport, ("127.0.0.1", dport))
        request.addfinalizer(proxies[i].close)
    # ~48 MB of fp32 weights: several times what the kernels buffer between the trainer and a rollout
    # (8 MiB each way here), so a rollout that takes nothing more blocks the trainer's sends to it
    taddr, rollouts, sets = _fleet(procs, tmp_path, proxies, vocab_size=16384)

    # an unpaced sync opens the sync links and says how many bytes a stream is
    load(taddr, sets[1])
    rep = sync_rpc(taddr)
    assert rep.ok, rep
    stream_bytes = rep.bytes
    assert stream_bytes > 4 * (8 << 20), stream_bytes
    # pace every link so a normal stream takes about STREAM_S: long against liveness_timeout_s, so a
    # stop mid-stream must not cost the healthy rollouts more than that timeout (and a ping period)
    for p in proxies.values():
        p.set("slow", rate=stream_bytes / STREAM_S)
    normal = []
    for k in range(3):
        load(taddr, sets[k % 2])
        t0 = time.monotonic()
        rep = sync_rpc(taddr)
        normal.append(time.monotonic() - t0)
        assert rep.ok and rep.transport == "tcp", rep
        print(f"\nnormal paced sync {normal[-1]:.3f}s: phases {dict(rep.phase_seconds)}")
    normal_s = statistics.median(normal)

    stopped = rollouts[2]
    stopped_at = []

    def stop():  # from the proxy's pump, once an eighth of the stream reached it: mid-stream
        os.kill(stopped.popen.pid, signal.SIGSTOP)
        proxies[2].links.stall_after[0] = 0  # and its host takes nothing more: the trainer's sends fill up
        stopped_at.append(time.monotonic())

    proxies[2].links.hooks.append((0, stream_bytes // 8, stop))
    v = load(taddr, sets[1])
    before = status(rstub(stopped)).version
    try:
        t0 = time.monotonic()
        rep = sync_rpc(taddr, timeout=4 * RPC_TIMEOUT_S)
        took = time.monotonic() - t0
        assert stopped_at, "the stream never reached a quarter of its bytes at the stopped rollout's proxy"
        by_id = {x.rollout_id: x for x in rep.rollouts}
        print(f"with one stopped mid-stream {took:.3f}s: phases {dict(rep.phase_seconds)}; {by_id[stopped.name]}")
        print(f"normal {normal_s:.3f}s (median), with one stopped mid-stream {took:.3f}s: {took / normal_s:.2f}x")
        assert all(by_id[r.name].ok and status(rstub(r)).version == v for r in rollouts[:2]), rep
        bad = by_id[stopped.name]
        assert not bad.ok and "silent mid-stream" in bad.error and "stale" in bad.error, bad
        # the healthy two commit within twice their normal sync time (measured above, same run, same pace)
        assert took < 2 * normal_s, (took, normal)
    finally:
        os.kill(stopped.popen.pid, signal.SIGCONT)
    for p in proxies.values():
        p.set("pass")
    # it resumes with part of a stream: it never commits that (no CommitSync reaches it, the broken stream
    # aborts it), and the catch-up after its next heartbeat brings it to v whole and exact
    wait_for(lambda: status(rstub(stopped)).version == v, 60, "the stopped rollout caught up")
    assert before < v and torch.equal(score(rstub(stopped))[0], score(rstub(rollouts[0]))[0])
    rep = sync_rpc(taddr)  # and it takes the next sync with the others
    assert rep.ok and all(x.ok for x in rep.rollouts), rep
