"""Scoped tokens (issue 37): the rollout's generation key grants generation only.

With `generation_token` set beside `auth_token`, the generation key is accepted by the OpenAI
routes and by the Generate and Score RPCs, and refused (UNAUTHENTICATED / 401) everywhere else:
sync calls, status, the admin HTTP surface. The admin token still grants everything; a wrong key
grants nothing. The config refuses a generation key without an admin token.
"""

from __future__ import annotations

import grpc
import pytest

from tests.support.local_apps import rollout_app, start_rollout
from tests.unit.weightsync.http.rest_helpers import http
from weightsync.config import ConfigError
from weightsync.control.client import channel, rollout_stub
from weightsync.v1 import rollout_pb2

ADMIN = "admin-s3cret"
GEN = "generation-key"


@pytest.fixture(scope="module")
def rollout():
    app = start_rollout("r", auth_token=ADMIN, generation_token=GEN, serve_initial_weights=True)
    yield app
    app.stop()


def _code(fn, *args) -> grpc.StatusCode:
    try:
        fn(*args)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_the_generation_key_grants_generate_and_score_only_over_grpc(rollout):
    gen = rollout_stub(channel(rollout.grpc.address), GEN, 30)
    admin = rollout_stub(channel(rollout.grpc.address), ADMIN, 30)
    wrong = rollout_stub(channel(rollout.grpc.address), "nope", 30)
    generate = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=[1, 2, 3])], sampling=rollout_pb2.SamplingParams(max_new_tokens=2)
    )
    score = rollout_pb2.ScoreRequest(token_ids=[1, 2, 3], prompt_length=1)
    for stub, ok in ((gen, True), (admin, True), (wrong, False)):
        want = grpc.StatusCode.OK if ok else grpc.StatusCode.UNAUTHENTICATED
        assert _code(stub.Generate, generate) == want
        assert _code(stub.Score, score) == want
    for call in (
        lambda s: s.AbortSync(rollout_pb2.AbortSyncRequest(sync_id="x")),
        lambda s: s.CommitSync(rollout_pb2.CommitSyncRequest(sync_id="x")),
        lambda s: s.PrepareSync(rollout_pb2.PrepareSyncRequest()),
        lambda s: s.GetStatus(rollout_pb2.GetStatusRequest()),
    ):
        assert _code(call, gen) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(call, admin) != grpc.StatusCode.UNAUTHENTICATED


def test_the_generation_key_grants_the_openai_routes_over_http(rollout):
    port = rollout.http.port
    for token, want in ((GEN, 200), (ADMIN, 200), ("nope", 401)):
        auth = {"Authorization": f"Bearer {token}"}
        assert http(port, "/v1/models", headers=auth)[0] == want
        code, _, text = http(port, "/v1/completions", body={"prompt": [1, 2], "max_tokens": 2}, headers=auth)
        assert code == want, text


def test_the_bearer_middleware_keeps_a_scoped_token_to_its_prefixes():
    import asyncio

    from weightsync.http.auth import BearerAuth

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    mw = BearerAuth(app, ADMIN, prefixes=("/v1/",), scoped=[(GEN, ("/v1/completions",))])

    def status(path: str, token: str) -> int:
        sent = []

        async def send(msg):
            sent.append(msg)

        scope = {"type": "http", "path": path, "headers": [(b"authorization", f"Bearer {token}".encode())]}
        asyncio.run(mw(scope, None, send))
        return sent[0]["status"]

    assert status("/v1/completions", GEN) == 200 and status("/v1/sync", GEN) == 401
    assert status("/v1/sync", ADMIN) == 200 and status("/v1/completions", "nope") == 401


def test_a_generation_key_needs_an_admin_token_and_must_differ_from_it():
    from rollout_svc.config import RolloutConfig

    with pytest.raises(ConfigError, match="needs auth_token"):
        RolloutConfig.from_flat(model="tiny-qwen2", generation_token=GEN).validate()
    with pytest.raises(ConfigError, match="not both"):
        RolloutConfig.from_flat(
            model="tiny-qwen2", auth_token=ADMIN, generation_token=GEN, generation_token_file="/x"
        ).validate()
    with pytest.raises(ConfigError, match="must differ"):
        rollout_app("r", auth_token=ADMIN, generation_token=ADMIN)
