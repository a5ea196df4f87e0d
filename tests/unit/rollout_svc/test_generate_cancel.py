"""A Generate whose client cancels, or whose deadline passes, stops and frees the engine within a second.

Before, the work went on: a client that gave up left minutes of decoding behind, and every small
request queued behind it. Real in-process rollout (built-in engine, tiny-qwen2), real gRPC calls.
"""

from __future__ import annotations

import time

import grpc
import pytest

from tests.support.local_apps import rollout_app, start_rollout
from weightsync.control.client import channel
from weightsync.v1 import rollout_pb2, rollout_pb2_grpc

# minutes of decoding on the tiny model if it ran to the end
BIG = rollout_pb2.GenerateRequest(
    prompts=[rollout_pb2.Prompt(token_ids=[1, 2, 3])] * 50, sampling=rollout_pb2.SamplingParams(max_new_tokens=500, n=8)
)


@pytest.fixture(scope="module")
def rollout():
    app = start_rollout("c", serve_initial_weights=True)
    yield app
    app.stop()


def _wait(pred, timeout: float) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError
        time.sleep(0.005)
    return time.monotonic() - t0


def _cancelled(app) -> float:
    return app.servicer.rollout_metrics.requests.labels("rollout", "cancelled")._value.get()


def _cancel_big_request(app) -> float:
    """Start BIG, cancel it once it runs; seconds until the engine is free again."""
    gate = app.tx.engine_lock
    with channel(app.grpc.address) as ch:
        fut = rollout_pb2_grpc.RolloutStub(ch).Generate.future(BIG, timeout=300)
        _wait(lambda: gate.locked(), 10)
        time.sleep(0.3)
        fut.cancel()
        return _wait(lambda: not gate.locked(), 5)


def test_cancelled_generate_frees_the_engine_within_a_second(rollout):
    before = _cancelled(rollout)
    assert _cancel_big_request(rollout) < 1.0
    _wait(lambda: _cancelled(rollout) == before + 1, 5)


def test_generate_stops_when_its_deadline_passes(rollout):
    gate = rollout.tx.engine_lock
    with channel(rollout.grpc.address) as ch:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            rollout_pb2_grpc.RolloutStub(ch).Generate(BIG, timeout=1.0)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _wait(lambda: not gate.locked(), 5)
        assert time.monotonic() - t0 < 2.0
        # and the engine serves the next request at once
        t1 = time.monotonic()
        rollout_pb2_grpc.RolloutStub(ch).Generate(
            rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(token_ids=[1, 2])], sampling=rollout_pb2.SamplingParams(max_new_tokens=4)
            ),
            timeout=10,
        )
        assert time.monotonic() - t1 < 2.0


def test_an_engine_that_stops_on_cancel_without_taking_turns_is_given_the_check():
    """SGLang's adapter runs a request whole (no turns between steps) but stops it when asked
    (`stops_on_cancel`): the service hands it the cancellation check, without the gate's turns."""
    from rollout_svc.engine.builtin import BuiltinEngine

    class WholeRequests(BuiltinEngine):
        yields_between_steps = False
        stops_on_cancel = True
        checks = 0

        def generate(self, prompts, sampling, step=None):
            assert step is not None, "a stops_on_cancel engine must be given the cancellation check"

            def counted():
                WholeRequests.checks += 1
                step()

            return super().generate(prompts, sampling, step=counted)

    app = rollout_app("w", serve_initial_weights=True)
    app.tx.engine.__class__ = WholeRequests
    app.start()
    try:
        assert _cancel_big_request(app) < 1.0
        assert WholeRequests.checks > 0
    finally:
        app.stop()
