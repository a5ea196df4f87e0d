"""`Rollout/ReleaseMemory` at the service boundary (colocated RL, issue 47): a real rollout (gRPC and HTTP)
whose engine is the SGLang adapter over tests/support/fake_sglang.py, started with enable_memory_saver. While
released, gRPC Generate answers UNAVAILABLE and the OpenAI route 503, both naming the release, and no request
reaches SGLang; the call's own argument is validated; an engine that cannot release refuses with
FAILED_PRECONDITION; the status, readiness and the metrics say it."""

from __future__ import annotations

import json
import math

import grpc
import pytest

from tests.support.fake_sglang import FakeSglang, adapter_on, scripted
from tests.support.local_apps import start_rollout
from tests.unit.weightsync.http.rest_helpers import AUTH, TOKEN, byte_level_model, http
from weightsync.control.client import channel, rollout_stub
from weightsync.v1 import rollout_pb2

RELEASED = "the engine's GPU memory is released for a colocated train step"


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    path = byte_level_model(tmp_path_factory.mktemp("sglang-release-model"))
    app = start_rollout(
        "sglang-release", model=path, auth_token=TOKEN, serve_initial_weights=True, apply_mode="inplace"
    )
    yield app, rollout_stub(channel(app.grpc.address), TOKEN, 30)
    app.stop()


def _generate(stub):
    req = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=[1, 2])], sampling=rollout_pb2.SamplingParams(max_new_tokens=2)
    )
    return stub.Generate(req)


def _metric(app, name: str) -> float:
    status, _, text = http(app.http.port, "/metrics", headers=AUTH)
    assert status == 200
    rows = [ln for ln in text.splitlines() if ln.startswith(name) and 'role="rollout"' in ln]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in rows)


def test_release_refuses_requests_over_grpc_and_http_until_a_sync_commits(rollout):
    app, stub = rollout
    own = app.tx.engine
    fake = FakeSglang(scripted([5, 6], [-0.1, -0.2]))
    app.tx.engine = adapter_on(fake, colocated=True)
    try:
        assert [s.token_ids for s in _generate(stub).samples] == [[5, 6]]
        before = _metric(app, "weightsync_memory_releases_total")
        resp = stub.ReleaseMemory(rollout_pb2.ReleaseMemoryRequest(timeout_seconds=5))
        assert list(resp.released) == ["weights", "kv_cache", "cuda_graph"] and resp.state == rollout_pb2.SERVING
        assert fake.offload_tags == {"weights", "kv_cache", "cuda_graph"}
        assert stub.GetStatus(rollout_pb2.GetStatusRequest()).memory_released
        assert _metric(app, "weightsync_memory_released{") == 1.0
        assert _metric(app, "weightsync_memory_releases_total") == before + 1
        calls = len(fake.calls)
        with pytest.raises(grpc.RpcError) as exc:
            _generate(stub)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and RELEASED in exc.value.details()
        status, _, text = http(app.http.port, "/v1/completions", {"prompt": [[1, 2]], "max_tokens": 2}, headers=AUTH)
        assert status == 503 and RELEASED in json.dumps(json.loads(text)), text
        assert len(fake.calls) == calls  # neither reached SGLang
        status, _, text = http(app.http.port, "/readyz")  # a Service routes no traffic to it meanwhile
        assert status == 503 and "GPU memory released" in text, text
    finally:
        app.tx.memory_released = False  # the module's rollout serves again for the next test
        app.servicer.refresh_state_metric()
        app.tx.engine = own
    assert http(app.http.port, "/readyz")[0] == 200


@pytest.mark.parametrize("t", [-1.0, math.nan, math.inf, 601.0])
def test_release_validates_its_timeout(rollout, t):
    app, stub = rollout
    with pytest.raises(grpc.RpcError) as exc:
        stub.ReleaseMemory(rollout_pb2.ReleaseMemoryRequest(timeout_seconds=t))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_seconds" in exc.value.details()
    assert not app.tx.memory_released


def test_an_engine_that_cannot_release_refuses_and_keeps_serving(rollout):
    app, stub = rollout  # the built-in engine
    with pytest.raises(grpc.RpcError) as exc:
        stub.ReleaseMemory(rollout_pb2.ReleaseMemoryRequest())
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "enable_memory_saver" in exc.value.details()
    assert not stub.GetStatus(rollout_pb2.GetStatusRequest()).memory_released
    _generate(stub)
