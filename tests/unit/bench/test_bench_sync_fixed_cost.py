"""bench/bench_sync_fixed_cost.py runs the colocated trainer_writes sync it claims to time: the in-place
buckets written into the engine (the table shared and mapped once), the rollout in this process and in its
own, and with --ab every other sync prepared the old way (its phases kept apart)."""

from __future__ import annotations

import tempfile
import time
import types

import pytest

from bench import bench_sync_fixed_cost as bench
from bench.common.models import write_config


@pytest.fixture(scope="module")
def model():
    from weightsync.publisher.stream_phase import StreamPhase

    kept = StreamPhase._in_place
    bench._in_place_on_cpu()
    try:
        yield str(write_config("tiny-thin", tempfile.mkdtemp(prefix="bench-sync-fixed-cost-")))
    finally:
        StreamPhase._in_place = kept


@pytest.mark.parametrize("separate", [False, True], ids=["rollout-inline", "rollout-process"])
def test_the_bench_times_trainer_writes_syncs_in_place(model, separate):
    args = types.SimpleNamespace(bucket_kb=16, warmup=1, reps=4, ab=False)
    r = bench.run("ipc", model, args, time.monotonic() + 120, separate=separate)
    m = r["median_ms"]
    assert r["samples"] == 4 and r["num_buckets"] > 1
    assert m["stream.trainer_writes"] > 0 and m["prepare.in_place"] > 0  # written from the actor's own storage
    assert 0 < m["fixed"] < m["seconds"] and m["rollout.PrepareSync"] > 0 and m["rollout.CommitSync"] > 0
    assert len(r["raw_s"]["rollout.PrepareSync"]) == 4


def test_ab_keeps_the_old_prepare_apart(model, monkeypatch):
    from weightsync.publisher.attempt import SyncAttempt

    monkeypatch.setattr(SyncAttempt, "_prepare_answers", SyncAttempt._prepare_answers)  # undone after
    bench._ab_prepare()
    args = types.SimpleNamespace(bucket_kb=16, warmup=1, reps=4, ab=True)
    r = bench.run("ipc", model, args, time.monotonic() + 120, separate=False)
    raw = r["raw_s"]
    assert len(raw["prepare"]) == len(raw["before:prepare"]) == 2
    assert len(raw["rollout.PrepareSync"]) == len(raw["before:rollout.PrepareSync"]) == 2


def test_ab_fixed_work_runs_every_other_sync_with_a_thread_and_every_state_series_written(model, monkeypatch):
    import threading

    from rollout_svc.service import RolloutServicer
    from weightsync.bus import pipeline

    # undone after: the bench replaces both for the rest of its process
    monkeypatch.setattr(RolloutServicer, "refresh_state_metric", RolloutServicer.refresh_state_metric)
    monkeypatch.setattr(pipeline, "PRODUCERS", pipeline.PRODUCERS)
    bench._ab_fixed_work()
    started = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda t: (started.append(t.name), start(t))[1])
    args = types.SimpleNamespace(bucket_kb=16, warmup=1, reps=4, ab=True)
    r = bench.run("tcp", model, args, time.monotonic() + 120, separate=False)
    raw = r["raw_s"]
    assert len(raw["seconds"]) == len(raw["before:seconds"]) == 2
    assert len(raw["rollout.PrepareSync"]) == len(raw["before:rollout.PrepareSync"]) == 2
    # the producer on a thread of its own in exactly the "before" syncs (the warm-up, rep 0, is an "after")
    assert started.count("pack-per-sync") == 2
