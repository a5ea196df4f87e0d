"""A trainer-writes prepare waits for generation as long as the sync may, and a hung one still fails fast.

On the trainer_writes path the rollout pauses generation inside PrepareSync (it waits for its running
requests to finish before it lets the trainer write). That wait belongs to the sync, not to one RPC:
the trainer bounds that prepare by what is left of the sync's deadline, not rpc_timeout_s. Here a
request holds the engine longer than rpc_timeout_s: the sync still commits; and a rollout that stops
beating on its sync link while it waits (hung) fails within liveness_timeout_s, long before the deadline.
Real services on a CPU, with the GPU boundary faked as in test_trainer_writes_services.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_trainer_writes_services import TOKEN

from rollout_svc.sync import link_server
from tests.support.fake_gpu import FakeGpu, fake_gpu_boundary
from tests.support.fleet_sync import bump_weights
from tests.support.local_apps import local_fleet
from weightsync.v1 import rollout_pb2, trainer_pb2

RPC_TIMEOUT_S = 1.0
LIVENESS_S = 1.0
SYNC_TIMEOUT_S = 20.0
GENERATION_S = 2.5  # > rpc_timeout_s, well within the sync's deadline


@pytest.fixture(scope="module")
def pair():
    gpu = FakeGpu()
    with local_fleet(
        {"a": {"apply_mode": "inplace"}},
        TOKEN,
        stub_timeout_s=120,
        rpc_timeout_s=RPC_TIMEOUT_S,
        liveness_timeout_s=LIVENESS_S,
    ) as (trainer, rollouts, stub):
        fake_gpu_boundary(trainer, rollouts["a"], gpu)
        yield trainer, rollouts["a"], stub


def _generation(app, seconds: float | None, release: threading.Event | None = None) -> threading.Thread:
    """A request pinned on the engine for `seconds` (or until `release`), started before this returns."""
    pinned = threading.Event()

    def run():
        with app.tx.engine_lock.pinned(timeout=5):
            pinned.set()
            if release is not None:
                release.wait(30)
            else:
                time.sleep(seconds)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert pinned.wait(5)
    return t


def _sync(stub) -> tuple[trainer_pb2.SyncReport, float]:
    t0 = time.monotonic()
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc", timeout_seconds=SYNC_TIMEOUT_S)).report
    return report, time.monotonic() - t0


def test_a_prepare_that_waits_for_generation_longer_than_rpc_timeout_commits(pair):
    trainer, app, stub = pair
    bump_weights(trainer)
    report, _ = _sync(stub)  # the table is offered and mapped; the link is opened
    assert report.ok and "stream.trainer_writes" in report.phase_seconds, [r.error for r in report.rollouts]
    bump_weights(trainer)
    gen = _generation(app, GENERATION_S)
    report, took = _sync(stub)
    gen.join(10)
    assert report.ok, [r.error for r in report.rollouts]
    assert "stream.trainer_writes" in report.phase_seconds
    # the prepare waited for the request past rpc_timeout_s (on the link: beating all along)
    assert report.phase_seconds["prepare"] > RPC_TIMEOUT_S and took >= GENERATION_S - 0.5, report.phase_seconds
    assert app.tx.version == trainer.actor.version and app.tx.state == rollout_pb2.SERVING
    for name, t in trainer.actor.export_tensors():
        assert torch.equal(app.engine._target(name), t), name


def test_a_rollout_that_hangs_in_that_prepare_fails_within_the_liveness_not_the_deadline(pair, monkeypatch):
    trainer, app, stub = pair
    bump_weights(trainer)
    assert _sync(stub)[0].ok  # the sync link is open: this prepare goes over it
    beater = app.link._beater
    # hung after reading the request: it acknowledges it (as it does first thing) and never beats again
    monkeypatch.setattr(beater, "begin", _acknowledge_only)
    release = threading.Event()
    gen = _generation(app, None, release)
    try:
        bump_weights(trainer)
        report, took = _sync(stub)
        assert not report.ok
        (r,) = report.rollouts
        assert "silent" in r.error and "liveness" in r.error, r.error
        assert took < LIVENESS_S + 3.0 < SYNC_TIMEOUT_S, took
    finally:
        release.set()
        gen.join(10)
        monkeypatch.undo()
    # the rollout resumes: the next sync supersedes what it prepared and catches it up
    deadline = time.monotonic() + 15
    report = None
    while time.monotonic() < deadline:
        report, _ = _sync(stub)
        if report.ok:
            break
        time.sleep(0.3)
    assert report is not None and report.ok, [r.error for r in report.rollouts]
    assert app.tx.version == trainer.actor.version and app.tx.state == rollout_pb2.SERVING


def _acknowledge_only(conn, send_lock) -> None:
    with send_lock:
        conn.sendall(link_server._ACK)
