"""What a steady-state sync does besides moving bytes, counted (not timed) through the real services on a CPU.

The fixed cost of a colocated sync (CUDA IPC, the trainer writing into the engine: a 7B's write pass is
7.5 ms on an H200) is round trips and per-sync host work (bench/bench_sync_fixed_cost.py). Timings on
a shared CPU cannot catch a regression of a fraction of a millisecond; counts can. Once a rollout holds
the layout, a sync to it is exactly two round trips on its sync link (PrepareSync naming the layout by
digest, CommitSync), and re-plans, re-validates, re-shares and re-maps nothing, walks no bucket's
tensors, starts no thread and sends no other call; the rollout's state metric writes only the series
whose value changes.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

import rollout_svc.sync.transaction as transaction
from tests.support.fake_gpu import FakeGpu, fake_gpu_boundary
from tests.support.fleet_sync import assert_serves_export, bump_weights, rollout_calls
from tests.support.local_apps import local_fleet
from weightsync.bus.plan import BucketPlan
from weightsync.publisher.link_client import SyncLinkClient
from weightsync.v1 import trainer_pb2

STEADY_SYNCS = 4
WAIT_S = 10.0


@pytest.fixture(scope="module")
def pair():
    gpu = FakeGpu()
    with local_fleet({"a": {"apply_mode": "inplace"}}) as (trainer, rollouts, stub):
        fake_gpu_boundary(trainer, rollouts["a"], gpu)
        trainer.orch.bucket_bytes = 64 << 10  # several buckets
        yield trainer, rollouts["a"], stub, gpu


def _sync(stub) -> trainer_pb2.SyncReport:
    report = stub.Sync(trainer_pb2.SyncRequest(transport="ipc", ipc_direction="trainer_writes")).report
    assert report.ok, [r.error for r in report.rollouts]
    assert "stream.trainer_writes" in report.phase_seconds, report.phase_seconds
    return report


class _Counting:
    """Counts, from its start, the calls of what a steady-state sync must not repeat."""

    def __init__(self, monkeypatch, trainer, app, gpu):
        self.trainer, self.app, self.gpu = trainer, app, gpu
        self.validated = 0  # layouts the rollout checked against its engine, tensor by tensor
        self.threads: list[str] = []  # threads started in this process (both services)
        self.prepare_buckets: list[int] = []  # bucket entries each PrepareSync carried (0: the digest alone)
        self.state_writes = 0  # series of the rollout's state metric written
        self.bucket_walks = 0  # sums over a bucket's tensors (per tensor: a layout's, computed once)
        plan_apply = transaction.plan_apply

        def counting_plan_apply(*a, **k):
            self.validated += 1
            return plan_apply(*a, **k)

        monkeypatch.setattr(transaction, "plan_apply", counting_plan_apply)
        tensor_bytes = BucketPlan.tensor_bytes.fget

        def counting_tensor_bytes(plan):
            self.bucket_walks += 1
            return tensor_bytes(plan)

        monkeypatch.setattr(BucketPlan, "tensor_bytes", property(counting_tensor_bytes))
        start = threading.Thread.start

        def counting_start(thread):
            self.threads.append(thread.name)
            return start(thread)

        monkeypatch.setattr(threading.Thread, "start", counting_start)
        prepare = app.servicer.PrepareSync  # the attribute the sync link and gRPC both call

        def recording_prepare(request, *context):
            self.prepare_buckets.append(len(request.manifest.buckets))
            return prepare(request, *context)

        monkeypatch.setattr(app.servicer, "PrepareSync", recording_prepare)
        for series in app.servicer.rollout_metrics._states.values():
            set_ = series.set

            def counting_set(value, set_=set_):
                self.state_writes += 1
                return set_(value)

            monkeypatch.setattr(series, "set", counting_set)
        self.calls = rollout_calls(trainer)
        self.plans = trainer.orch.manifests.plans
        self.shares, self.opens = gpu.shares, gpu.opens

    def new_calls(self) -> dict[tuple[str, str], float]:
        now = rollout_calls(self.trainer)
        return {k: n - self.calls.get(k, 0) for k, n in now.items() if n != self.calls.get(k, 0)}


def test_a_steady_state_sync_is_two_round_trips_on_the_link_and_repeats_no_setup(pair, monkeypatch):
    trainer, app, stub, gpu = pair
    for _ in range(2):  # the first sends the layout and shares the table; the second is steady already
        bump_weights(trainer)
        _sync(stub)
    counting = _Counting(monkeypatch, trainer, app, gpu)
    for _ in range(STEADY_SYNCS):
        bump_weights(trainer)
        _sync(stub)
        assert_serves_export(trainer, app)
    n = STEADY_SYNCS
    assert counting.new_calls() == {("PrepareSync", "link"): n, ("CommitSync", "link"): n}
    assert counting.prepare_buckets == [0] * n  # the layout by digest, never the manifest again
    assert trainer.orch.manifests.plans == counting.plans  # not re-planned
    assert counting.validated == 0  # the layout's check against the engine is kept by digest
    assert (gpu.shares, gpu.opens) == (counting.shares, counting.opens)  # the table named by id, mapped once
    assert counting.threads == []  # no thread (nor executor) per sync, on either side
    assert counting.bucket_walks == 0  # the stream's byte count is the layout's, not summed tensor by tensor
    # SERVING -> SYNCING at prepare, SYNCING -> SERVING at commit: two series written each time
    assert counting.state_writes == 4 * n


def test_the_state_metric_shows_one_state_as_it_changes(pair):
    trainer, app, stub, _ = pair

    def shown() -> dict[str, float]:
        (fam,) = [f for f in app.servicer.metrics.registry.collect() if f.name == "weightsync_rollout_state"]
        return {s.labels["state"]: s.value for s in fam.samples}

    bump_weights(trainer)
    _sync(stub)
    after_sync = shown()
    assert after_sync["SERVING"] == 1 and sum(after_sync.values()) == 1, after_sync
    app.tx.state = transaction.S.STALE  # as a failed in-place apply leaves it
    try:
        app.servicer.refresh_state_metric()
        stale = shown()
    finally:
        app.tx.state = transaction.S.SERVING
        app.servicer.refresh_state_metric()
    assert stale["STALE"] == 1 and sum(stale.values()) == 1, stale
    assert set(stale) == set(after_sync)  # every state keeps its series, at 0 when not current


def test_the_rollouts_sync_log_lines_are_written_after_its_answers_went_out(pair, monkeypatch):
    # a log line costs its formatting and write: not inside the round trips the trainer waits on
    trainer, app, stub, _ = pair
    bump_weights(trainer)
    _sync(stub)  # the link is open
    answered = {"PrepareSync": threading.Event(), "CommitSync": threading.Event()}
    answer_of = SyncLinkClient._answer_of

    def reading(self, sock, method, *rest):
        try:
            return answer_of(self, sock, method, *rest)
        finally:
            answered[method].set()

    monkeypatch.setattr(SyncLinkClient, "_answer_of", reading)
    order: list[tuple[str, bool]] = []

    class _Waits(logging.Handler):
        """Holds each line until the trainer read the answer it follows (a line written before the answer
        would hold the answer: the wait runs out, False)."""

        def emit(self, record):
            for line, method in (("prepared sync", "PrepareSync"), ("committed sync", "CommitSync")):
                if record.getMessage().startswith(line):
                    order.append((line, answered[method].wait(WAIT_S)))

    handler, logger = _Waits(level=logging.INFO), logging.getLogger("rollout_svc.service")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        bump_weights(trainer)
        _sync(stub)
        answered["CommitSync"].wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while len(order) < 2 and time.monotonic() < deadline:  # the commit's line follows its answer
            time.sleep(0.01)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert order == [("prepared sync", True), ("committed sync", True)]
    assert_serves_export(trainer, app)
