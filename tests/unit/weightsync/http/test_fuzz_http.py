"""Property-based fuzzing of the REST endpoints against real in-process services.

Like tests/unit/weightsync/control/test_fuzz_grpc.py for the gRPC handlers: every request, however malformed,
gets a deliberate answer: 2xx, or 4xx with a message (503 "busy" is deliberate too), never a 500
(an unhandled exception) or a hang; the services keep serving afterwards. Values are drawn around
the edges (NaN, inf, huge and negative numbers, lone surrogates, wrong types, unknown fields), with
valid generation sizes kept small so the run stays bounded (< 60 s).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.weightsync.http.rest_helpers import AUTH, TOKEN, http

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=20)
)
json_any = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
huge = st.one_of(st.integers(-(2**70), 0), st.integers(2**31, 2**70))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-320, 1e308]))
weird_text = st.one_of(st.text(max_size=30), st.sampled_from(["\ud800", "\x00", "a" * 5000, "ok", "tcp"]))


def _dumps(body) -> bytes:
    # allow_nan: Python's json reads NaN/Infinity, so a client can send them
    return json.dumps(body, allow_nan=True).encode()


def _check(code: int, text: str, what) -> None:
    assert code < 500 or code == 503, f"{what}: {code} {text[:500]}"
    if code >= 400:
        err = json.loads(text)["error"]  # OpenAI's error body, for every error
        assert err["message"].strip() and err["type"], f"{what}: {code} without a message"


completion_body = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(
            st.lists(st.integers(-(2**40), 300), max_size=4),
            st.lists(st.lists(st.integers(0, 300), max_size=3), max_size=3),
            weird_text,
            st.lists(weird_text, max_size=2),
            json_any,
        ),
        "max_tokens": st.one_of(st.integers(1, 4), huge, json_leaf),
        "temperature": st.one_of(floats, json_leaf),
        "top_p": st.one_of(floats, json_leaf),
        "top_k": st.one_of(st.integers(-5, 5), huge),
        "n": st.one_of(st.integers(1, 3), huge, json_leaf),
        "logprobs": st.one_of(st.integers(-3, 8), huge, json_leaf),
        "seed": st.one_of(st.integers(0, 2**63 + 5), huge, json_leaf),
        "stop_token_ids": st.lists(st.integers(-(2**70), 2**70), max_size=3),
        "stream": json_leaf,
        "echo": json_leaf,
        "model": st.one_of(json_leaf, st.just("tiny-qwen2")),
        "user": json_leaf,
        "stop": st.one_of(json_leaf, st.lists(weird_text, max_size=3)),
        "stream_options": st.one_of(json_any, st.just({"include_usage": True})),
        "bogus": json_leaf,
    },
)

sync_body = st.fixed_dictionaries(
    {},
    optional={
        "rollout_ids": st.one_of(st.lists(weird_text, max_size=3), json_any, st.just(["r1"])),
        "transport": st.one_of(weird_text, st.sampled_from(["", "tcp", "nccl", "ipc"]), json_leaf),
        "timeout_seconds": st.one_of(floats, huge, json_leaf, st.just(20.0)),
        "senders": st.one_of(weird_text, st.sampled_from(["", "all", "rank0"]), json_leaf),
        "allow_rollback": json_leaf,
        "extra": json_leaf,
    },
)


@settings(max_examples=150, **SETTINGS)
@given(body=st.one_of(completion_body, json_any))
def test_fuzz_completions(services, body):
    _, rollout = services
    code, headers, text = http(rollout.http.port, "/v1/completions", raw=_dumps(body), headers=AUTH, timeout=30)
    _check(code, text, body)
    if code == 200 and headers["Content-Type"].startswith("text/event-stream"):  # stream: a lax true
        events = [line[len("data: ") :] for line in text.split("\n\n") if line]
        assert events[-1] == "[DONE]" and len(events) > 2, text[:500]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["weight_version"] == rollout.tx.version for c in chunks)
        assert [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    elif code == 200:
        out = json.loads(text)
        assert out["weight_version"] == rollout.tx.version and out["choices"]


@settings(max_examples=100, **SETTINGS)
@given(body=st.one_of(sync_body, json_any))
def test_fuzz_sync(services, body):
    trainer, _ = services
    code, _, text = http(trainer.http.port, "/v1/sync", raw=_dumps(body), headers=AUTH, timeout=60)
    _check(code, text, body)


@settings(max_examples=100, **SETTINGS)
@given(
    raw=st.binary(max_size=200),
    path=st.sampled_from(["/v1/completions", "/v1/sync", "/v1/status", "/readyz"]),
    ctype=st.sampled_from(["application/json", "text/plain", "multipart/form-data", ""]),
    auth=st.one_of(
        st.just(f"Bearer {TOKEN}"),
        # a valid header value (printable ASCII and tabs): any other control character (a form feed
        # drawn on 2026-11-26) makes no HTTP request at all, and the server's HTTP parser answers a
        # plain-text 400 and drops the connection before the application sees anything
        weird_text.filter(lambda s: all(c == "\t" or " " <= c <= "~" for c in s)),
    ),
)
def test_fuzz_raw_requests(services, raw, path, ctype, auth):
    trainer, rollout = services
    port = rollout.http.port if path == "/v1/completions" else trainer.http.port
    code, _, text = http(
        port, path, raw=raw, method="POST", headers={"Content-Type": ctype, "Authorization": auth}, timeout=30
    )
    _check(code, text, (path, raw, ctype, auth))


def test_services_still_serve_after_fuzzing(services):
    trainer, rollout = services
    code, _, text = http(trainer.http.port, "/v1/sync", body={"rollout_ids": ["r1"]}, headers=AUTH)
    assert code == 200 and json.loads(text)["ok"] is True
    assert rollout.tx.version == trainer.actor.version
    assert http(rollout.http.port, "/readyz")[0] == 200
    code, _, text = http(rollout.http.port, "/v1/completions", body={"prompt": [1, 2], "max_tokens": 2}, headers=AUTH)
    assert code == 200 and json.loads(text)["weight_version"] == trainer.actor.version
    assert not rollout.tx.engine_lock.locked()  # no request left holding the engine
