"""The HTTP side of both services, against real in-process services on loopback ports.

Probes and metrics behave as before the move to FastAPI; the trainer's REST mirror answers what
the gRPC admin API answers (same validation, same JSON as `wsctl --json`); a rollout's
/v1/completions is gRPC Generate in OpenAI's shape, token for token; both refuse bodies over the
limit before reading them.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from google.protobuf.json_format import MessageToDict
from prometheus_client import CONTENT_TYPE_LATEST

from tests.support.local_apps import start_rollout
from tests.unit.weightsync.http.rest_helpers import AUTH, TOKEN, error_message, http
from weightsync.control.client import channel, rollout_stub, trainer_stub
from weightsync.v1 import rollout_pb2, trainer_pb2


# ---- probes and metrics (unchanged behaviour) ----------------------------------------------
def test_probes_and_metrics(services):
    trainer, rollout = services
    for app in (trainer, rollout):
        code, headers, body = http(app.http.port, "/healthz")
        assert (code, body) == (200, "ok\n") and headers["Content-Type"].startswith("text/plain")
        code, _, body = http(app.http.port, "/readyz")
        assert code == 200 and "version" in body
        code, headers, body = http(app.http.port, "/metrics")
        assert code == 200 and headers["Content-Type"] == CONTENT_TYPE_LATEST
        assert "weightsync_weights_version" in body
        code, _, body = http(app.http.port, "/nope")
        assert code == 404 and "/healthz" in body
        code, _, _ = http(app.http.port, "/healthz", body={}, method="POST")
        assert code == 405


def test_readyz_is_503_with_the_reason_when_stale(services):
    _, rollout = services
    state, err = rollout.tx.state, rollout.tx.last_error
    rollout.tx.state, rollout.tx.last_error = rollout_pb2.STALE, "sync x aborted"
    try:
        code, _, body = http(rollout.http.port, "/readyz")
    finally:
        rollout.tx.state, rollout.tx.last_error = state, err
    assert code == 503 and "STALE: sync x aborted" in body


def test_port_clash_fails_at_construction_and_stop_is_bounded():
    from prometheus_client import CollectorRegistry

    from weightsync.http import serve_http

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}.*port"):
            serve_http(f"127.0.0.1:{port}", title="t", registry=CollectorRegistry(), ready=lambda: (True, "ok"))
    srv = serve_http("127.0.0.1:0", title="t", registry=CollectorRegistry(), ready=lambda: (time.sleep(30), "x")[::-1])
    srv.start()
    hung = socket.create_connection(("127.0.0.1", srv.port))
    hung.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")  # its handler sleeps 30 s
    time.sleep(0.3)
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < srv.grace_s + 4
    hung.close()


# ---- auth -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [("/v1/status", None), ("/v1/sync", {"rollout_ids": ["none"]})])
def test_rest_needs_the_token_exactly_once(services, path, body):
    trainer, _ = services
    port = trainer.http.port
    assert http(port, path, body)[0] == 401
    code, headers, text = http(port, path, body, headers={"Authorization": "Bearer wrong"})
    assert code == 401 and headers["WWW-Authenticate"] == "Bearer" and "token" in text
    assert http(port, path, body, headers={"Authorization": TOKEN})[0] == 401  # no "Bearer "
    # one right and one wrong header: refused (the gRPC interceptor would take any match)
    req = (
        f"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Authorization: Bearer wrong\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req)
        assert s.recv(100).startswith(b"HTTP/1.1 401")
    assert http(port, "/healthz")[0] == 200 and http(port, "/openapi.json")[0] == 200  # probes stay open


# ---- trainer REST mirror ------------------------------------------------------------------
def test_status_is_grpc_getstatus_as_json(services):
    trainer, _ = services
    code, _, body = http(trainer.http.port, "/v1/status", headers=AUTH)
    assert code == 200
    got = json.loads(body)
    with channel(trainer.grpc.address) as ch:
        want = MessageToDict(
            trainer_stub(ch, TOKEN).GetStatus(trainer_pb2.TrainerStatusRequest()),
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        )
    assert set(got) == set(want)
    for k in ("version", "model_family", "num_parameters", "backend", "origin"):
        assert got[k] == want[k], k
    assert [r["rollout_id"] for r in got["rollouts"]] == ["r1"]


def test_sync_commits_and_reports(services):
    trainer, rollout = services
    code, _, body = http(trainer.http.port, "/v1/sync", body={"rollout_ids": ["r1"], "transport": "tcp"}, headers=AUTH)
    assert code == 200, body
    rep = json.loads(body)
    assert rep["ok"] is True and rep["rollouts"][0]["rollout_id"] == "r1"
    assert rollout.tx.version == trainer.actor.version == int(rep["version"])
    assert rollout.tx.origin == trainer.orch.origin
    code, _, body = http(trainer.http.port, "/v1/sync", method="POST", headers=AUTH)  # no body: all rollouts
    assert code == 200 and json.loads(body)["ok"] is True


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ({"rollout_ids": ["nope"]}, 404, "nope"),
        ({"transport": "udp"}, 400, "transport"),
        ({"timeout_seconds": -1}, 400, "timeout_seconds"),
        ({"timeout_seconds": "soon"}, 400, "timeout_seconds"),
        ({"rollout_ids": "r1"}, 400, "rollout_ids"),
        ({"bogus": 1}, 400, "bogus"),
    ],
)
def test_sync_rejects_bad_bodies_naming_the_field(services, body, status, needle):
    trainer, _ = services
    code, _, text = http(trainer.http.port, "/v1/sync", body=body, headers=AUTH)
    assert code == status and needle in error_message(text), text


def test_malformed_json_is_a_400(services):
    trainer, _ = services
    code, _, text = http(trainer.http.port, "/v1/sync", raw=b"{not json", headers=AUTH)
    assert code == 400 and "JSON" in error_message(text)


def test_openapi_describes_the_api(services):
    trainer, rollout = services
    spec = json.loads(http(trainer.http.port, "/openapi.json")[2])
    assert {"/healthz", "/readyz", "/metrics", "/v1/status", "/v1/sync"} <= set(spec["paths"])
    assert set(spec["components"]["schemas"]["SyncBody"]["properties"]) == {
        "rollout_ids",
        "transport",
        "timeout_seconds",
        "senders",
        "allow_rollback",
    }
    spec = json.loads(http(rollout.http.port, "/openapi.json")[2])
    assert "/v1/completions" in spec["paths"] and "/v1/sync" not in spec["paths"]
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "top_p", "n", "logprobs", "seed"} <= set(props)


def test_oversized_body_is_413_before_it_is_read(services):
    trainer, _ = services
    with socket.create_connection(("127.0.0.1", trainer.http.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/sync HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {1 << 30}\r\n\r\n{{".encode()
        )
        assert s.recv(100).startswith(b"HTTP/1.1 413")


# ---- rollout /v1/completions ---------------------------------------------------------------
def _grpc_generate(rollout, prompts, **sampling):
    with channel(rollout.grpc.address) as ch:
        return rollout_stub(ch, TOKEN).Generate(
            rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(token_ids=p) for p in prompts],
                return_logprobs=True,
                sampling=rollout_pb2.SamplingParams(**sampling),
            )
        )


def test_completions_equal_grpc_generate(services):
    _, rollout = services
    prompts = [[5, 6, 7], [9, 10]]
    code, headers, body = http(
        rollout.http.port,
        "/v1/completions",
        headers=AUTH,
        body={
            "model": "tiny-qwen2",
            "prompt": prompts,
            "max_tokens": 7,
            "temperature": 0.8,
            "top_p": 0.9,
            "n": 2,
            "seed": 11,
            "logprobs": 1,
        },
    )
    assert code == 200, body
    out = json.loads(body)
    ref = _grpc_generate(rollout, prompts, max_new_tokens=7, temperature=0.8, top_p=0.9, n=2, seed=11)
    assert out["object"] == "text_completion" and out["model"] == "tiny-qwen2" and out["id"].startswith("cmpl-")
    assert out["weight_version"] == ref.version == int(headers["X-Weight-Version"]) == rollout.tx.version
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in out["choices"]] == [list(s.token_ids) for s in ref.samples]
    assert [c["logprobs"]["token_logprobs"] for c in out["choices"]] == [list(s.logprobs) for s in ref.samples]
    assert [c["finish_reason"] for c in out["choices"]] == [s.finish_reason for s in ref.samples]
    assert out["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": sum(len(s.token_ids) for s in ref.samples),
        "total_tokens": 5 + sum(len(s.token_ids) for s in ref.samples),
    }
    # a flat token list is one prompt; logprobs not asked -> null
    code, _, body = http(
        rollout.http.port,
        "/v1/completions",
        headers=AUTH,
        body={"prompt": [5, 6, 7], "max_tokens": 7, "temperature": 0.8, "top_p": 0.9, "seed": 11},
    )
    one = json.loads(body)
    assert one["choices"][0]["logprobs"] is None and len(one["choices"]) == 1
    ref = _grpc_generate(rollout, [[5, 6, 7]], max_new_tokens=7, temperature=0.8, top_p=0.9, seed=11)
    assert one["choices"][0]["token_ids"] == list(ref.samples[0].token_ids)


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"prompt": "hello"}, "token ids"),
        ({"prompt": [1, 2], "temperature": -1}, "temperature"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2], "n": 0}, "n="),
        ({"prompt": [1, 2], "top_p": 0}, "top_p"),
        ({"prompt": [1, 999]}, "999"),
        ({"prompt": []}, "prompts"),
        ({"prompt": [[]]}, "empty"),
        ({"prompt": [1, 2], "logprobs": 9}, "logprobs"),
        ({"prompt": [1, 2], "seed": -1}, "seed"),
        ({"prompt": [1, 2], "stream": [1]}, "stream"),
        ({"prompt": [1, 2], "stop": "\n"}, "stop"),  # stop strings need a tokenizer (tiny-qwen2 has none)
        ({"prompt": [1, 2], "stop": ["a"] * 17}, "stop"),
        ({"prompt": [1, 2], "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": [1, 2], "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_completions_reject_bad_requests_naming_the_field(services, body, needle):
    _, rollout = services
    code, _, text = http(rollout.http.port, "/v1/completions", body=body, headers=AUTH)
    assert code == 400 and needle in error_message(text), text


def test_completions_need_the_token(services):
    _, rollout = services
    assert http(rollout.http.port, "/v1/completions", body={"prompt": [1]})[0] == 401


def test_http_disconnect_frees_the_engine(services):
    _, rollout = services
    lock = rollout.tx.engine_lock
    body = json.dumps({"prompt": [[1, 2, 3]] * 50, "max_tokens": 500, "n": 8}).encode()
    s = socket.create_connection(("127.0.0.1", rollout.http.port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 10
    while not lock.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lock.locked(), "the request never started"
    time.sleep(0.3)
    s.close()
    t0 = time.monotonic()
    while lock.locked() and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert not lock.locked() and time.monotonic() - t0 < 1.0, time.monotonic() - t0


def test_text_prompts_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    from weightsync.models import TINY

    kw = dict(TINY["tiny-qwen2"])
    AutoConfig.for_model(kw.pop("model_type"), **kw).save_pretrained(str(tmp_path))
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the cat sat on a mat dog ran".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(tmp_path))
    app = start_rollout("tok", model=str(tmp_path), serve_initial_weights=True)
    try:
        code, _, body = http(
            app.http.port,
            "/v1/completions",
            body={"prompt": ["the cat sat", "a dog"], "max_tokens": 4, "temperature": 0, "logprobs": 0},
        )
        assert code == 200, body
        out = json.loads(body)
        hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)  # what a client of the model uses
        ids = [hf.encode(t, add_special_tokens=False) for t in ("the cat sat", "a dog")]
        assert all(ids) and out["usage"]["prompt_tokens"] == sum(map(len, ids))
        ref = _grpc_generate(app, ids, max_new_tokens=4, temperature=0)
        for c, s in zip(out["choices"], ref.samples, strict=True):
            assert c["token_ids"] == list(s.token_ids)
            assert c["text"] == hf.decode(list(s.token_ids))
            assert c["logprobs"]["tokens"] == [hf.decode([t]) for t in s.token_ids]
    finally:
        app.stop()
