"""Token streaming on a rollout's OpenAI surface: tokens go out as the engine decodes them.

A real rollout (built-in engine, tiny-qwen2, a byte-level tokenizer: one token per byte, so stop
strings and multi-byte characters span tokens). Nothing here is timed: the engine is held at a
decode step (a gated model, or a scripted engine) while the test reads what was sent before it.
Every stream is checked against the same request without `stream`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import openai
import pytest

from rollout_svc.engine.base import SampleResult, TokenOut
from rollout_svc.engine.builtin import BuiltinEngine
from rollout_svc.openai_api.incremental import ChoiceText
from rollout_svc.openai_api.streaming import Channel
from rollout_svc.openai_api.text import finish
from tests.support.local_apps import start_rollout
from tests.unit.weightsync.http.rest_helpers import AUTH, TOKEN, byte_level_model, open_stream
from weightsync.bus.errors import SyncError

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}<assistant> "
HOLD_S = 30.0  # the longest a held engine waits for the test (a failing test, not a slow one)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    from transformers import AutoTokenizer

    path = byte_level_model(tmp_path_factory.mktemp("stream-model"), CHAT_TEMPLATE)
    app = start_rollout("stream", model=path, auth_token=TOKEN, serve_initial_weights=True)
    yield app, AutoTokenizer.from_pretrained(path, local_files_only=True), path
    app.stop()


def _client(app):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{app.http.port}/v1", api_key=TOKEN, max_retries=0, timeout=60)


def _post_stream(app, path: str, body: dict):
    """(connection, response) of a streamed POST, once its headers came; read it with _events."""
    conn = http.client.HTTPConnection("127.0.0.1", app.http.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **AUTH})
    return conn, conn.getresponse()


def _events(resp):
    """The `data:` payloads of an SSE response, one at a time as they arrive ([DONE] as the string)."""
    while line := resp.readline():
        if line.startswith(b"data: "):
            data = line[6:].strip()
            yield data.decode() if data == b"[DONE]" else json.loads(data)


class Joined:
    """Per choice index: the streamed text, ids, log-probs and finish_reason, and every text piece."""

    def __init__(self):
        self.text, self.ids, self.lps, self.reason, self.pieces = {}, {}, {}, {}, {}

    def add(self, choice: dict) -> None:
        i = choice["index"]
        piece = choice["text"] if "text" in choice else choice["delta"].get("content") or ""
        self.text[i] = self.text.get(i, "") + piece
        self.pieces.setdefault(i, []).append((piece, choice["token_ids"]))
        self.ids.setdefault(i, []).extend(choice["token_ids"])
        lp = choice["logprobs"]
        if lp is not None:
            self.lps.setdefault(i, []).extend(
                lp["token_logprobs"] if "token_logprobs" in lp else [c["logprob"] for c in lp["content"]]
            )
        if choice["finish_reason"]:
            self.reason[i] = choice["finish_reason"]


# ---- engine doubles ------------------------------------------------------------------------------
class GatedModel:
    """The engine's model, held at its first decode step (a forward of one position per row) until
    `release` is set: what the stream sent by then was sent before generation went on."""

    def __init__(self, model):
        self.model, self.held, self.release = model, threading.Event(), threading.Event()

    def __call__(self, input_ids, **kw):
        if input_ids.shape[1] == 1 and not self.held.is_set():
            self.held.set()
            assert self.release.wait(HOLD_S), "the test never released the engine"
        return self.model(input_ids, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


@contextmanager
def gated(app):
    eng = app.tx.engine
    gate = eng.model = GatedModel(eng.model)
    try:
        yield gate
    finally:
        gate.release.set()
        eng.model = gate.model


@dataclass
class Script:
    """What a Scripted engine answers: every sample of every prompt gets `ids`."""

    ids: list[int]
    fail_at: int | None = None  # raise before this step
    hold_at: int | None = None  # wait for `release` before this step
    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class Scripted(BuiltinEngine):
    """Emits `self.script.ids` step by step as the built-in engine does (step() before each step, the
    tokens of all n samples of a step in one emit), so stops and characters fall where a test puts them."""

    streams_tokens = True

    def generate(self, prompts, sampling, step=None, emit=None):
        s, step = self.script, step or (lambda: None)
        lps = [-0.25 - j / 64 for j in range(len(s.ids))]
        for pi in range(len(prompts)):
            for j, t in enumerate(s.ids):
                step()
                if j == s.fail_at:
                    raise RuntimeError(f"scripted engine failure at step {j}")
                if j == s.hold_at:
                    s.held.set()
                    assert s.release.wait(HOLD_S), "the test never released the engine"
                last = "length" if j == len(s.ids) - 1 else None
                if emit is not None:
                    emit(pi, [TokenOut(r, t, lps[j], last) for r in range(sampling.n)])
        return [SampleResult(pi, list(s.ids), list(lps)) for pi in range(len(prompts)) for _ in range(sampling.n)]


class ScriptedWhole(Scripted):
    """The same answers from an engine that cannot stream: all of them at the end."""

    streams_tokens = False


class WholeAnswers(BuiltinEngine):
    """An engine that cannot stream (no `streams_tokens`): it is never given `emit`."""

    streams_tokens = False

    def generate(self, prompts, sampling, step=None, **kw):
        assert not kw, f"an engine without streams_tokens was given {sorted(kw)}"
        return super().generate(prompts, sampling, step=step)


@contextmanager
def engine_class(app, cls, script: Script | None = None):
    eng = app.tx.engine
    old, eng.__class__, eng.script = eng.__class__, cls, script
    try:
        yield script
    finally:
        if script is not None:
            script.release.set()
        eng.__class__ = old
        del eng.script


# ---- tokens go out as they are decoded --------------------------------------------------------------
def test_first_tokens_arrive_while_the_engine_is_held(rollout):
    """The official client reads the first chunk while the built-in engine is held at its first decode
    step; the whole stream then equals the answer without `stream` (ids, log-probs, n > 1, usage)."""
    app, _, model = rollout
    client = _client(app)
    args = {"model": model, "prompt": [[7, 8, 9], [10, 11]], "max_tokens": 6, "temperature": 0.8, "n": 2, "seed": 3}
    whole = client.completions.create(**args, logprobs=0)
    got, usage = Joined(), None
    with gated(app) as gate:
        stream = client.completions.create(**args, logprobs=0, stream=True, stream_options={"include_usage": True})
        chunks = iter(stream)
        first = next(chunks)
        assert gate.held.is_set() and not gate.release.is_set() and app.tx.engine_lock.locked()
        assert first.choices[0].model_extra["token_ids"], "the first chunk has no token"
        assert int(stream.response.headers["X-Weight-Version"]) == first.model_extra["weight_version"]
        gate.release.set()
        for chunk in [first, *chunks]:
            assert chunk.model_extra["weight_version"] == whole.model_extra["weight_version"]
            usage = chunk.usage or usage
            for c in chunk.choices:
                got.add(c.model_dump())
    assert [got.ids[i] for i in range(4)] == [c.model_extra["token_ids"] for c in whole.choices]
    assert [got.lps[i] for i in range(4)] == [c.logprobs.token_logprobs for c in whole.choices]
    assert [got.text[i] for i in range(4)] == [c.text for c in whole.choices]
    assert [got.reason[i] for i in range(4)] == [c.finish_reason for c in whole.choices]
    assert usage == whole.usage


def test_streamed_chat_with_logprobs_is_the_answer(rollout):
    app, _, model = rollout
    args = {
        "model": model,
        "messages": [{"role": "user", "content": "héllo"}],
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 11,
        "n": 2,
        "logprobs": True,
    }
    whole = _client(app).chat.completions.create(**args)
    got, roles = Joined(), {}
    for chunk in _client(app).chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            got.add(c.model_dump())
    for i, c in enumerate(whole.choices):
        assert got.text[i] == c.message.content and got.ids[i] == c.model_extra["token_ids"]
        assert got.lps[i] == [t.logprob for t in c.logprobs.content] and got.reason[i] == c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}


def test_an_engine_that_cannot_stream_sends_the_same_answer_at_its_end(rollout):
    app, _, model = rollout
    args = {"model": model, "prompt": [[3, 4], [8, 9]], "max_tokens": 5, "temperature": 0.9, "n": 2, "seed": 9}
    whole = _client(app).completions.create(**args, logprobs=0)
    got = Joined()
    with engine_class(app, WholeAnswers):
        for chunk in _client(app).completions.create(**args, logprobs=0, stream=True):
            for c in chunk.choices:
                got.add(c.model_dump())
    assert [got.ids[i] for i in range(4)] == [c.model_extra["token_ids"] for c in whole.choices]
    assert [got.lps[i] for i in range(4)] == [c.logprobs.token_logprobs for c in whole.choices]
    assert [got.text[i] for i in range(4)] == [c.text for c in whole.choices]


# ---- text held back: stop strings and split characters ------------------------------------------
TEXT = "say héllo, wörld ✓ 日本 done"


def _scripted_stream(app, hf, body: dict, cls=Scripted, **script):
    ids = hf.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT.encode())  # one token per byte
    with engine_class(app, cls, Script(ids, **script)):
        whole = json.loads(_post_json(app, "/v1/completions", body))
        conn, resp = _post_stream(app, "/v1/completions", {**body, "stream": True})
        got, events = Joined(), list(_events(resp))
        conn.close()
    for e in events[:-1]:
        for c in e["choices"]:
            got.add(c)
    assert events[-1] == "[DONE]"
    return whole, got, ids


def _post_json(app, path: str, body: dict) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", app.http.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **AUTH})
        resp = conn.getresponse()
        text = resp.read().decode()
        assert resp.status == 200, text
        return text
    finally:
        conn.close()


@pytest.mark.parametrize("cls", [Scripted, ScriptedWhole], ids=["streaming-engine", "whole-answer-engine"])
def test_a_stop_string_split_across_tokens_is_never_sent(rollout, cls):
    app, hf, _ = rollout
    stop = "wörld"  # six tokens, one character of them split over two
    whole, got, ids = _scripted_stream(app, hf, {"prompt": [1, 2], "max_tokens": 64, "stop": [stop], "n": 2}, cls)
    cut = TEXT[: TEXT.index(stop)]
    for i in (0, 1):
        c = whole["choices"][i]
        assert c["text"] == cut and c["finish_reason"] == "stop"
        assert got.text[i] == cut and got.ids[i] == c["token_ids"] and got.reason[i] == "stop"
        assert got.ids[i] == ids[: len(cut.encode()) + len(stop.encode())]  # up to the token that completed it
        sent = ""
        for piece, _ in got.pieces[i]:
            sent += piece
            assert cut.startswith(sent), f"{sent!r} went beyond the text before the stop string"
        # the "w" that starts it was held back with its token, not sent and taken back
        w = hf.encode("w", add_special_tokens=False)
        assert ("", w) in got.pieces[i] and not any(stop[:1] in p for p, _ in got.pieces[i])


def test_text_held_back_for_a_stop_string_that_never_completes_is_sent(rollout):
    app, hf, _ = rollout
    whole, got, ids = _scripted_stream(app, hf, {"prompt": [1, 2], "max_tokens": 64, "stop": ["wörst", "日本 dx"]})
    assert whole["choices"][0]["text"] == TEXT == got.text[0] and got.ids[0] == ids
    w = got.pieces[0].index(("", hf.encode("w", add_special_tokens=False)))  # held: "wör" may become "wörst"
    # w, ö's two bytes, r: nothing sent; l: "wörl" can no longer become "wörst", so it all goes
    assert [p for p, _ in got.pieces[0][w : w + 5]] == ["", "", "", "", "wörl"]
    assert got.reason[0] == "length"


def test_a_character_split_across_tokens_is_sent_whole(rollout):
    app, hf, _ = rollout
    # with echo: the prompt's text goes first, in a chunk of its own
    whole, got, ids = _scripted_stream(app, hf, {"prompt": "hi ✓ ", "max_tokens": 64, "echo": True})
    assert got.text[0] == whole["choices"][0]["text"] == "hi ✓ " + TEXT and got.ids[0] == ids
    assert got.pieces[0][0] == ("hi ✓ ", [])
    pieces = [p for p, _ in got.pieces[0][1:]]
    assert "\ufffd" not in "".join(pieces) and "✓" in pieces and "日" in pieces
    check = pieces.index("✓")
    assert pieces[check - 2 : check] == ["", ""]  # its first two bytes sent nothing


def test_stream_pieces_hold_back_split_characters(rollout):
    """ChoiceText alone: a piece per token, an incomplete character held, a stop string cut."""
    _, hf, _ = rollout
    text = "héllo, wörld ✓ 日本"
    ids = hf.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # one byte per token: "✓" spans 3 tokens

    def pieces_of(stops):
        c, pieces = ChoiceText(0, hf.decode, stops), []
        for t in ids:
            if c.stopped:
                break
            pieces.append(c.add(t, 0.0))
        final = finish([SampleResult(0, ids, [0.0] * len(ids))], hf.decode, stops)[0]
        pieces[-1] += c.close(final)[2]
        return pieces

    pieces = pieces_of([])
    assert "".join(pieces) == text and len(pieces) == len(ids)
    assert "\ufffd" not in "".join(pieces) and "✓" in pieces and "日" in pieces
    assert pieces[:3] == ["h", "", "é"]  # "é" waits for its second byte
    # a cut text (a stop string) ends the pieces where it ends
    assert "".join(pieces_of([text[5:8]])) == text[:5]


# ---- errors, disconnects, slow readers --------------------------------------------------------------
def test_an_error_after_the_stream_started_is_a_last_error_event(rollout):
    app, hf, model = rollout
    ids = hf.encode(TEXT, add_special_tokens=False)
    with engine_class(app, Scripted, Script(ids, fail_at=3)):
        conn, resp = _post_stream(app, "/v1/completions", {"prompt": [1, 2], "max_tokens": 64, "stream": True})
        assert resp.status == 200
        events = list(_events(resp))
        conn.close()
        assert events[-1] == "[DONE]" and set(events[-2]) == {"error"}
        assert "scripted engine failure at step 3" in events[-2]["error"]["message"]
        assert [e["choices"][0]["token_ids"] for e in events[:-2]] == [[t] for t in ids[:3]]
        # the official client raises it, after the chunks before it
        seen = []
        with pytest.raises(openai.APIError, match="scripted engine failure"):
            for chunk in _client(app).completions.create(model=model, prompt=[1, 2], max_tokens=64, stream=True):
                seen.append(chunk)
        assert len(seen) == 3


def test_a_refusal_before_the_first_token_is_an_http_error(rollout):
    """The engine refuses the prompt once admitted (a token id outside the vocabulary): no stream started,
    so it is an ordinary 400 with OpenAI's error body."""
    app, _, model = rollout
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary") as e:
        _client(app).completions.create(model=model, prompt=[1, 999], max_tokens=4, stream=True)
    assert e.value.status_code == 400


def test_a_client_that_disconnects_mid_stream_frees_the_engine(rollout):
    app, _, _ = rollout
    cancelled = app.servicer.rollout_metrics.requests.labels("rollout", "cancelled")
    before = cancelled._value.get()
    # once the stream started, tokens are being decoded
    s = open_stream(app.http.port, {"prompt": [[1, 2, 3]] * 50, "max_tokens": 500, "n": 8, "stream": True})
    assert app.tx.engine_lock.locked()
    s.close()
    t0 = time.monotonic()
    while app.tx.engine_lock.locked() and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert not app.tx.engine_lock.locked() and time.monotonic() - t0 < 1.0, time.monotonic() - t0
    while cancelled._value.get() != before + 1 and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert cancelled._value.get() == before + 1


def test_a_stalled_reader_stops_the_producer():
    """The engine's thread never waits on a reader for long: with the channel full, a put waits at most
    stall_s, then the generation is cancelled; once the reader is gone, a put fails at once."""
    loop = asyncio.new_event_loop()
    try:
        ch = Channel(loop, capacity=2, stall_s=0.3)
        ch.put("a"), ch.put("b")
        t0 = time.monotonic()
        with pytest.raises(SyncError, match="read none") as e:
            ch.put("c")
        assert e.value.code == "CANCELLED" and 0.3 <= time.monotonic() - t0 < 5 and ch.closed.is_set()
        # a reader that goes away while the channel is full frees the producer within a poll, not stall_s
        ch = Channel(loop, capacity=1, stall_s=30)
        ch.put("a")
        threading.Timer(0.2, ch.closed.set).start()
        t0 = time.monotonic()
        with pytest.raises(SyncError, match="went away"):
            ch.put("b")
        assert time.monotonic() - t0 < 5
        # a reader that takes events makes room again
        ch = Channel(loop, capacity=1, stall_s=5)
        ch.put(1)
        loop.call_soon(lambda: None)
        assert loop.run_until_complete(ch.get(5)) == [1]
        ch.put(2)
        assert loop.run_until_complete(ch.get(5)) == [2]
    finally:
        loop.close()


def test_a_client_that_stops_reading_stops_the_generation(rollout, monkeypatch):
    """End to end: a client that sends a stream request and reads nothing. Once the socket buffers are
    full the response stops taking events, the channel fills, and the engine's thread gives up after
    STALL_S: the generation is cancelled and the engine is free, though the connection is still open."""
    from rollout_svc.openai_api import streaming

    app, _, _ = rollout
    monkeypatch.setattr(streaming, "QUEUE_EVENTS", 2)
    monkeypatch.setattr(streaming, "STALL_S", 0.3)
    cancelled = app.servicer.rollout_metrics.requests.labels("rollout", "cancelled")
    before = cancelled._value.get()
    # 64 chunks a step, with log-probs: the socket buffers fill within a few hundred steps
    body = {"prompt": [[1, 2, 3]] * 10, "max_tokens": 500, "n": 64, "logprobs": 1, "stream": True}
    body = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few chunks
    s.connect(("127.0.0.1", app.http.port))
    try:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        t0 = time.monotonic()
        while cancelled._value.get() != before + 1 and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        assert cancelled._value.get() == before + 1, "the generation went on for a reader that read nothing"
        t1 = time.monotonic()
        while app.tx.engine_lock.locked() and time.monotonic() - t1 < 5:
            time.sleep(0.01)
        assert not app.tx.engine_lock.locked()
    finally:
        s.close()
