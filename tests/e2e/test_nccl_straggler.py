"""Issue 49: one NCCL member stopped mid-stream no longer holds the others to the sync's deadline.

Real trainer-svc and rollout-svc processes on loopback, transport nccl over the gloo stand-in for
libnccl (tests/support/gloo_nccl.py: real broadcasts between the processes). A collective cannot lose
one rank: the trainer cuts the stopped member out once its sync link has answered no ping for
liveness_timeout_s (it aborts the group; the live members get AbortSync), and restarts the sync for
the live members at once in a group built without it. Nothing here races the sync: the stand-in paces
the trainer's broadcasts (a normal stream lasts STREAM_S however fast the box is), and holds the stream
before its third bucket (of ~20) until the test has stopped the rollout, so the stop lands mid-stream
by construction. The stopped member's kernel keeps what it was sent until its buffers fill; the stream
(48 MB) is several times that, so the broadcast really blocks on it: without the cut this sync waits
out its deadline (sync_timeout_s).

Checked: the two live members commit exactly the trainer's weights within 2x the same run's normal
sync time plus one group build; the stopped one is reported silent and stale, keeps its version, and
after SIGCONT its catch-up brings it to the trainer's version with identical logits; the next sync
takes all three.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch
from reliability_helpers import load, make_model_dirs, rstub, score, status, sync_rpc, wait_for

from weightsync.local.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # times the others against a normal sync
REPO_ROOT = Path(__file__).resolve().parents[2]
LIVENESS_S = 1.0
RPC_TIMEOUT_S = 30.0
SYNC_TIMEOUT_S = 120.0
#: how long the paced stream of a normal sync lasts
STREAM_S = 4.0
BUCKET_MB = 1


def _stream_bytes(weights: Path) -> int:
    """The bytes a sync of these weights streams (fp32 safetensors: the tensors plus a small header)."""
    return sum(f.stat().st_size for f in weights.glob("*.safetensors"))


@pytest.fixture
def nccl_fleet(procs, tmp_path, monkeypatch):
    # ~48 MB of fp32 weights: several times what the kernels buffer between two processes on loopback
    cfg_dir, sets = make_model_dirs(tmp_path / "models", [11, 12], vocab_size=16384)
    nbytes = _stream_bytes(sets[0])
    hold = tmp_path / "hold"
    for service in ("TRAINER", "ROLLOUT"):  # the services' debug.nccl_bus, by their env prefixes
        monkeypatch.setenv(f"WS_{service}_NCCL_BUS", "tests.support.gloo_nccl:GlooNcclBus")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("WS_GLOO_PACE_BPS", str(nbytes / STREAM_S))
    monkeypatch.setenv("WS_GLOO_HOLD", str(hold))
    monkeypatch.setenv("WS_GLOO_HOLD_RANK", "0")
    monkeypatch.setenv("WS_GLOO_HOLD_AT", "3")  # two of its ~20 buckets went through
    taddr = f"127.0.0.1:{free_port()}"
    rollouts = [
        procs.rollout(
            *("--model", str(cfg_dir), "--init-seed", "7", "--trainer-address", taddr, "--heartbeat-s", "1"),
            name=f"r{i}",
            grpc_port=free_port(),
        )
        for i in range(3)
    ]
    for r in rollouts:
        r.wait_ready()
    trainer = procs.trainer(
        *("--model", str(sets[0]), "--bucket-mb", str(BUCKET_MB), "--grpc-address", taddr, "--transport", "nccl"),
        *("--rpc-timeout-s", str(RPC_TIMEOUT_S), "--liveness-timeout-s", str(LIVENESS_S)),
        *("--sync-timeout-s", str(SYNC_TIMEOUT_S), "--nccl-init-timeout-s", "30"),
        # full buckets: the paced, held plain stream (a framed delta stream broadcasts on the group itself)
        *("--sync-encoding", "full"),
        backend="hf",
    )
    trainer.wait_ready()
    for r in rollouts:
        wait_for(lambda r=r: status(rstub(r)).version == 1, 120, f"{r.name} catch-up to v1")
    return taddr, rollouts, sets, hold


def _timed_sync(taddr, **kw):
    t0 = time.monotonic()
    rep = sync_rpc(taddr, timeout=SYNC_TIMEOUT_S + 30, **kw)
    return rep, time.monotonic() - t0


def test_an_nccl_member_stopped_mid_stream_is_cut_out_and_the_others_commit_exactly(nccl_fleet):
    taddr, rollouts, sets, hold = nccl_fleet
    # the first sync of these pairings opens the sync links (the stream is watched on them)
    load(taddr, sets[1])
    rep, _ = _timed_sync(taddr)
    assert rep.ok and rep.transport == "nccl", rep
    want = score(rstub(rollouts[0]))[0]  # what the weights of sets[1] serve
    normal = []
    for k in range(3):  # the cached group of three: what a sync costs normally
        load(taddr, sets[k % 2])
        rep, took = _timed_sync(taddr)
        assert rep.ok, rep
        normal.append(took)
        print(f"\nnormal nccl sync {took:.3f}s: phases {dict(rep.phase_seconds)}")
    normal_s = statistics.median(normal)
    # one group build: a sync to two of them builds a group of two, and the next to all three another
    rep, _ = _timed_sync(taddr, rollout_ids=["r0", "r1"])
    assert rep.ok, rep
    rep, fresh_s = _timed_sync(taddr)
    assert rep.ok, rep
    build_s = max(0.0, fresh_s - normal_s)
    print(f"a sync that builds its group {fresh_s:.3f}s: one build ~{build_s:.3f}s")

    stopped = rollouts[2]
    before = status(rstub(stopped)).version
    v = load(taddr, sets[1])
    hold.touch()
    out: dict = {}

    def run():
        out["rep"], out["took"] = _timed_sync(taddr)

    t = threading.Thread(target=run)
    t.start()
    try:
        wait_for(lambda: Path(f"{hold}.held").exists(), 60, "the stream reached its third bucket")
        held_at = time.monotonic()
        os.kill(stopped.popen.pid, signal.SIGSTOP)
        hold.unlink()
        held_s = time.monotonic() - held_at  # the test's own time inside the sync: not the sync's
        t.join(SYNC_TIMEOUT_S + 60)
        assert not t.is_alive()
        rep, took = out["rep"], out["took"] - held_s
        by_id = {x.rollout_id: x for x in rep.rollouts}
        print(f"with one stopped mid-stream {took:.3f}s: phases {dict(rep.phase_seconds)}; {by_id[stopped.name]}")
        print(
            f"normal {normal_s:.3f}s (median), build {build_s:.3f}s, with one cut mid-stream {took:.3f}s: "
            f"{took / normal_s:.2f}x normal"
        )
        for r in rollouts[:2]:
            st = status(rstub(r))
            assert by_id[r.name].ok and by_id[r.name].version == v and st.version == v, rep
            assert torch.equal(score(rstub(r))[0], want)  # exact: the checksums held, and so do the logits
        bad = by_id[stopped.name]
        assert not bad.ok and "silent mid-stream" in bad.error and "stale" in bad.error, bad
        assert took < 2 * normal_s + build_s, (took, normal, fresh_s)
    finally:
        os.kill(stopped.popen.pid, signal.SIGCONT)
        hold.unlink(missing_ok=True)
    # it resumes inside a stream whose group is gone: it never commits that; its next heartbeat's catch-up
    # brings it to v whole and exact (a new group of three), and the next sync takes all three
    wait_for(lambda: status(rstub(stopped)).version == v, 120, "the stopped rollout caught up")
    assert before < v and torch.equal(score(rstub(stopped))[0], want)
    rep, _ = _timed_sync(taddr)
    assert rep.ok and all(x.ok for x in rep.rollouts), rep
