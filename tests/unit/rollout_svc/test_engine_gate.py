"""The engine gate: requests interleave between decode steps without ever mixing weight versions.

Real built-in engine (tiny-qwen2) behind a SyncTransaction; the "sync" side is the gate's exclusive
acquire, exactly what a staged commit or an in-place first bucket takes. The engine takes turns here
(batch_requests=False, as a sliding-window model does); batched requests: engine/test_batcher.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rollout_svc.engine.base import SamplingParams
from rollout_svc.engine.builtin import BuiltinEngine
from rollout_svc.sync.engine_gate import MIN_LEAD_STEPS, EngineGate, GateError
from rollout_svc.sync.transaction import SyncTransaction
from weightsync.models import resolve_model


@pytest.fixture(scope="module")
def tx():
    config, _ = resolve_model("tiny-qwen2")
    return SyncTransaction(BuiltinEngine.from_config(config, seed=1, batch_requests=False))


def _gen(tx, prompts, sampling, is_active=lambda: True, steps=None):
    def run(eng, turn):
        def step():
            if steps is not None:
                steps.append(threading.current_thread().name)
            turn()

        return eng.generate(prompts, sampling, step=step)

    return tx.serve_turns(run, 10.0, is_active)


def _in_thread(fn):
    out = {}

    def target():
        try:
            out["result"] = fn()
        except Exception as exc:  # handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=target, name="long")
    t.start()
    return t, out


def test_short_request_interleaves_and_gets_the_same_tokens(tx):
    small = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    idle = _gen(tx, [[3, 4, 5]], small)[0]
    steps: list[str] = []
    big = SamplingParams(max_new_tokens=400, temperature=1.0, seed=3, n=4)
    t, out = _in_thread(lambda: _gen(tx, [[9, 8, 7]], big, steps=steps))
    while len(steps) < MIN_LEAD_STEPS + 4:  # the long one is far enough ahead to be overtaken
        time.sleep(0.005)
    at_start = len(steps)
    busy = _gen(tx, [[3, 4, 5]], small)[0]
    long_steps_during = len(steps) - at_start
    t.join(60)
    assert "result" in out, out
    # identical tokens and log-probs whether the engine was idle or shared with a long request
    assert [(r.token_ids, r.logprobs) for r in busy] == [(r.token_ids, r.logprobs) for r in idle]
    # and the short one did not wait for the long one (~380 steps to go): the long one made about one
    # step (the one in progress when the short one arrived) while the short one ran its seven
    assert long_steps_during <= 3, long_steps_during


def test_a_sync_waits_for_pinned_requests_and_new_requests_wait_for_the_sync(tx):
    gate = tx.engine_lock
    started, release = threading.Event(), threading.Event()

    def long_request(eng, turn):
        started.set()
        while not release.is_set():
            turn()
            time.sleep(0.001)
        return tx.version

    t, out = _in_thread(lambda: tx.serve_turns(long_request, 10.0))
    assert started.wait(5)
    # the pinned request holds the weights: a sync cannot take the engine, however often the request yields
    assert not gate.acquire(timeout=0.3)
    # while a sync waits, no new request is pinned (it would delay the sync indefinitely)
    got_sync = threading.Event()
    ts = threading.Thread(target=lambda: gate.acquire(timeout=10) and got_sync.set())
    ts.start()
    time.sleep(0.1)
    t2, out2 = _in_thread(lambda: tx.serve(lambda eng: tx.version, 10.0))
    time.sleep(0.2)
    assert t2.is_alive(), "a new request was served while a sync was waiting"
    release.set()
    t.join(10)
    assert got_sync.wait(5)
    version_before = out["result"][0]
    tx.version += 1  # the "sync" commits a new version while it holds the engine
    gate.release()
    ts.join(5)
    t2.join(10)
    # the request that queued behind the sync is served from the new version, and says so
    assert out2["result"] == (version_before + 1, version_before + 1)
    assert gate.idle


def test_cancel_stops_generation_at_the_next_step(tx):
    stop = threading.Event()
    sampling = SamplingParams(max_new_tokens=500, n=8)  # 50 prompts: minutes of work if it were not stopped
    t, out = _in_thread(lambda: _gen(tx, [[1, 2, 3]] * 50, sampling, is_active=lambda: not stop.is_set()))
    time.sleep(0.3)
    t0 = time.monotonic()
    stop.set()
    t.join(5)
    assert time.monotonic() - t0 < 1.0
    assert isinstance(out.get("error"), GateError) and out["error"].code == "CANCELLED"
    assert tx.engine_lock.idle


def test_gate_waits_are_bounded():
    gate = EngineGate()
    assert gate.acquire(timeout=1)
    t0 = time.monotonic()
    with pytest.raises(GateError) as ei:
        with gate.pinned(0.3):
            pass
    assert ei.value.code == "UNAVAILABLE" and time.monotonic() - t0 < 2
    gate.release()
    with pytest.raises(RuntimeError):
        gate.release()
    with gate.pinned(1):
        assert not gate.acquire(timeout=0.05)
    assert gate.idle and gate.acquire(timeout=0.1)
    gate.release()


def test_generate_without_step_is_unchanged(tx):
    s = SamplingParams(max_new_tokens=5, seed=2)
    a = tx.engine.generate([[1, 2]], s)
    b = _gen(tx, [[1, 2]], s)[0]
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert torch.tensor(a[0].logprobs).allclose(torch.tensor(b[0].logprobs), atol=0, rtol=0)


def test_a_lent_turn_lets_another_request_run_and_is_taken_back():
    """Turn.lend (a stream waiting for its reader): another request gets the engine while the lender
    waits, and the lender takes a turn again once what it waits for came and the engine is free."""
    gate = EngineGate()
    ready, waiting, order = threading.Event(), threading.Event(), []

    def lender():
        with gate.pinned(10) as turn:

            def wait(t: float) -> bool:
                waiting.set()
                return ready.wait(t)

            came = turn.lend(wait, 10)
            order.append(("lender back", came, gate._holder is turn))

    t, out = _in_thread(lender)
    assert waiting.wait(10)
    with gate.pinned(10) as other:  # no wait: the lender holds its pin but not the engine
        assert gate._holder is other
        ready.set()
        other()  # a step: the lender (0 steps) is not far enough behind to take the engine yet
        order.append("other done")
    t.join(10)
    assert not t.is_alive() and "error" not in out
    assert order == ["other done", ("lender back", True, True)] and gate.idle


def test_a_lent_turn_is_bounded_and_stops_on_cancel():
    gate = EngineGate()
    with gate.pinned(10) as turn:
        t0 = time.monotonic()
        assert turn.lend(lambda t: False, 0.2) is False  # nothing came: it has its turn back all the same
        assert 0.2 <= time.monotonic() - t0 < 5 and gate._holder is turn
    active = [True]
    with gate.pinned(10, lambda: active[0]) as turn:
        active[0] = False
        t0 = time.monotonic()
        with pytest.raises(GateError, match="cancelled") as e:
            turn.lend(lambda t: time.sleep(t) or False, 30)
        assert e.value.code == "CANCELLED" and time.monotonic() - t0 < 5
    assert gate.idle
