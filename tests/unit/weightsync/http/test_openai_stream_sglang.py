"""The OpenAI surface streams with `--engine sglang`: tokens go out as SGLang makes them.

A real rollout (tiny-qwen2, a byte-level tokenizer: one token per byte) whose engine is the SGLang adapter
driving tests/support/fake_sglang.py (SGLang's Engine as 0.5.10 / 0.5.23 stream: cumulative items, aborts
on Engine.loop). Nothing is timed: the fake holds its engine at a step until the test releases it, and
every SGLang answer is compared with the built-in engine's answer to the same request (a scripted
built-in engine, tests/unit/weightsync/http/test_openai_stream.py, giving the same tokens).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from tests.support.fake_sglang import FakeSglang, adapter_on, scripted
from tests.support.local_apps import start_rollout
from tests.unit.weightsync.http.rest_helpers import TOKEN, byte_level_model, open_stream
from tests.unit.weightsync.http.test_openai_stream import (
    CHAT_TEMPLATE,
    HOLD_S,
    TEXT,
    Joined,
    Script,
    Scripted,
    _events,
    _post_json,
    _post_stream,
    engine_class,
)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    from transformers import AutoTokenizer

    path = byte_level_model(tmp_path_factory.mktemp("sglang-stream-model"), CHAT_TEMPLATE)
    app = start_rollout("sglang-stream", model=path, auth_token=TOKEN, serve_initial_weights=True)
    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = hf.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT.encode())  # one token per byte
    yield app, ids
    app.stop()


def _lps(ids):  # the log-probs the scripted built-in engine gives
    return [-0.25 - j / 64 for j in range(len(ids))]


@contextmanager
def on_sglang(app, fake: FakeSglang):
    """The rollout's engine is the SGLang adapter on `fake` (its own engine is back on exit)."""
    own = app.tx.engine
    app.tx.engine = adapter_on(fake)
    try:
        yield fake
    finally:
        fake.release()
        app.tx.engine = own


def _answer(app, body: dict, stream: bool) -> tuple[dict, dict]:
    """(choice index -> (text, token_ids, log-probs, finish_reason), usage) of one /v1/completions request."""
    if not stream:
        out = json.loads(_post_json(app, "/v1/completions", body))
        choices = {
            c["index"]: (c["text"], c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"])
            for c in out["choices"]
        }
        return choices, out["usage"]
    conn, resp = _post_stream(
        app, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = list(_events(resp))
    conn.close()
    assert events[-1] == "[DONE]", events[-2:]
    got, usage = Joined(), None
    for e in events[:-1]:
        usage = e.get("usage") or usage
        for c in e["choices"]:
            got.add(c)
    return {i: (got.text[i], got.ids[i], got.lps[i], got.reason[i]) for i in got.ids}, usage


def test_sglang_streams_its_first_tokens_while_it_is_still_generating(rollout):
    """The first chunk arrives before SGLang, held at its third step until the test releases it, could
    finish any request; the whole stream then joins to the answer without `stream`, which is the built-in
    engine's answer."""
    app, ids = rollout
    body = {"prompt": [[1, 2], [3]], "max_tokens": 64, "n": 2, "logprobs": 0}
    with engine_class(app, Scripted, Script(ids)):
        builtin, builtin_usage = _answer(app, body, stream=False)
    with on_sglang(app, FakeSglang(scripted(ids, _lps(ids)))):
        whole, whole_usage = _answer(app, body, stream=False)
    assert whole == builtin and whole_usage == builtin_usage and len(whole) == 4
    with on_sglang(app, FakeSglang(scripted(ids, _lps(ids)), hold_at=3, hold_s=HOLD_S)) as fake:
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        conn, resp = _post_stream(app, "/v1/completions", stream_body)
        events = _events(resp)
        first = next(events)
        assert first["choices"][0]["token_ids"], "the first chunk has no token"
        # it came before the release: SGLang cannot get past its third step (nor finish any request) without it
        assert fake.held.wait(HOLD_S) and not fake.finished and app.tx.engine_lock.locked()
        assert max(fake.made.values()) == 3
        # the stream holds its version pin: a sync cannot take the engine (nor pause SGLang) under it
        assert not app.tx.engine_lock.acquire(blocking=False)
        fake.release()
        rest = list(events)
        conn.close()
    assert rest[-1] == "[DONE]" and fake.finished == set(fake.calls[0]["rid"])
    t0 = time.monotonic()  # the pin goes with the response's end, just after [DONE] was sent
    while app.tx.engine_lock.locked() and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert app.tx.engine_lock.acquire(blocking=False)  # nothing in flight: a sync may go
    app.tx.engine_lock.release()
    got, usage = Joined(), None
    for e in [first, *rest[:-1]]:
        usage = e.get("usage") or usage
        for c in e["choices"]:
            got.add(c)
    assert {i: (got.text[i], got.ids[i], got.lps[i], got.reason[i]) for i in got.ids} == builtin
    assert usage == builtin_usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_ends_sglangs_request_where_the_builtin_engine_ends_it(rollout, stream):
    """One choice's stop string completes: SGLang's request for it is aborted at that token (it decodes
    no further), and the answer is exactly the built-in engine's (text cut before the stop string,
    token ids and log-probs up to the token that completed it, finish_reason "stop")."""
    app, ids = rollout
    stop = "wörld"  # six tokens, one character of them split over two
    body = {"prompt": [[1, 2]], "max_tokens": 64, "n": 2, "logprobs": 0, "stop": [stop]}
    with engine_class(app, Scripted, Script(ids)):
        builtin, builtin_usage = _answer(app, body, stream)
    with on_sglang(app, FakeSglang(scripted(ids, _lps(ids)))) as fake:
        got, usage = _answer(app, body, stream)
    assert got == builtin and usage == builtin_usage
    cut = len(TEXT[: TEXT.index(stop)].encode()) + len(stop.encode())  # up to the token that completed it
    assert got[0] == (TEXT[: TEXT.index(stop)], ids[:cut], _lps(ids)[:cut], "stop") and got[1] == got[0]
    (call,) = fake.calls
    assert call["stream"] is True  # stop strings are watched as SGLang streams, streamed or not
    assert sorted(fake.aborted) == sorted(call["rid"])
    assert all(fake.made[r] == cut for r in call["rid"]) and cut < len(ids)


def test_a_client_that_disconnects_aborts_sglangs_requests(rollout):
    """SGLang is held after two steps (an abort is the only thing that ends its hold); the client reads
    the first chunk and goes away: every request of its call is aborted in SGLang, the engine is free,
    and the request counts as cancelled."""
    app, ids = rollout
    cancelled = app.servicer.rollout_metrics.requests.labels("rollout", "cancelled")
    before = cancelled._value.get()
    body = {"prompt": [[1, 2], [3]], "max_tokens": 64, "n": 2, "stream": True}
    with on_sglang(app, FakeSglang(scripted(ids, _lps(ids)), hold_at=2, hold_s=HOLD_S)) as fake:
        s = open_stream(app.http.port, body)
        assert fake.held.wait(HOLD_S) and app.tx.engine_lock.locked() and not fake.aborted
        s.close()
        t0 = time.monotonic()
        while (app.tx.engine_lock.locked() or cancelled._value.get() != before + 1) and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        rids = fake.calls[0]["rid"]
        assert sorted(fake.aborted) == sorted(rids) and fake.finished == set(rids)
        assert not app.tx.engine_lock.locked() and cancelled._value.get() == before + 1
        assert max(fake.made.values()) == 2  # nothing decoded after the hold: no orphaned generation


class _Streamer:
    """One streamed /v1/completions request, sent and read to its end on a thread of its own (its headers come
    only once the engine admitted it)."""

    def __init__(self, app, body: dict):
        self.events: list = []
        self.error: BaseException | None = None
        self.done, self.started = threading.Event(), threading.Event()
        self.conn = None
        self._thread = threading.Thread(target=self._read, args=(app, body), daemon=True)
        self._thread.start()

    def _read(self, app, body):
        try:
            self.conn, resp = _post_stream(app, "/v1/completions", {**body, "stream": True})
            self.started.set()
            for e in _events(resp):
                self.events.append(e)
        except BaseException as exc:  # noqa: BLE001 — the test reads it
            self.error = exc
        finally:
            if self.conn is not None:
                self.conn.close()
            self.done.set()

    def answer(self, timeout: float) -> dict:
        assert self.done.wait(timeout), "the stream did not end"
        assert self.error is None and self.events and self.events[-1] == "[DONE]", (self.error, self.events[-2:])
        got = Joined()
        for e in self.events[:-1]:
            for c in e["choices"]:
                got.add(c)
        return {i: (got.text[i], got.ids[i], got.lps[i], got.reason[i]) for i in got.ids}


def _wait_for(cond, what: str, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_sglang_requests_from_different_clients_run_at_once(rollout):
    """SGLang batches requests itself: a request does not wait for another to end. Request A is held inside
    SGLang (the fake) after two steps until the test releases it; request B, from another client, is answered
    whole while A is still held, and A then ends with its full answer. Both answers are the built-in engine's
    (with turns, B would wait for A's pin-holder to finish, which only the release allows)."""
    app, ids = rollout
    a_body = {"prompt": [[1, 2]], "max_tokens": 64, "n": 2, "logprobs": 0}
    b_body = {"prompt": [[3]], "max_tokens": 64, "n": 1, "logprobs": 0}
    with engine_class(app, Scripted, Script(ids)):
        a_builtin, _ = _answer(app, a_body, stream=False)
        b_builtin, _ = _answer(app, b_body, stream=False)
    fake = FakeSglang(scripted(ids, _lps(ids)), hold_at=2, hold_s=HOLD_S, hold_prompt=[1, 2])
    with on_sglang(app, fake):
        a = _Streamer(app, a_body)
        assert fake.held.wait(HOLD_S)
        b, _ = _answer(app, b_body, stream=False)
        a_rids = set(fake.calls[0]["rid"])
        assert b == b_builtin
        # A is still held in SGLang, its pin too, and nothing of it was aborted
        assert not a.done.is_set() and not a_rids & fake.finished and not fake.aborted
        assert max(fake.made[r] for r in a_rids) == 2 and app.tx.engine_lock.pins == 1
        fake.release()
        assert a.answer(HOLD_S) == a_builtin


def test_a_sync_waits_for_every_concurrent_request_and_holds_back_new_ones(rollout):
    """Two requests run at once (both held in SGLang). A sync taking the engine (what the transaction's commit
    does: engine_lock.acquire) waits until neither holds its pin, and while it waits a third request does not
    start (it never reaches SGLang); it runs once the sync is done. Every answer is the built-in engine's."""
    app, ids = rollout
    bodies = [{"prompt": [[p]], "max_tokens": 64, "n": 1, "logprobs": 0} for p in (1, 2, 3)]
    with engine_class(app, Scripted, Script(ids)):
        builtin = [_answer(app, b, stream=False)[0] for b in bodies]
    fake = FakeSglang(scripted(ids, _lps(ids)), hold_at=1, hold_s=HOLD_S)
    with on_sglang(app, fake):
        first = [_Streamer(app, b) for b in bodies[:2]]
        _wait_for(lambda: len(fake.calls) == 2 and app.tx.engine_lock.pins == 2, "both requests in SGLang")
        synced, sync_done = [], threading.Event()

        def sync():
            synced.append(app.tx.engine_lock.acquire(timeout=HOLD_S))
            sync_done.set()

        threading.Thread(target=sync, daemon=True).start()
        _wait_for(lambda: app.tx.engine_lock._writers_waiting == 1, "the sync to wait")
        third = _Streamer(app, bodies[2])
        time.sleep(0.3)  # room for the third request to (wrongly) get a pin; nothing below depends on its speed
        assert not sync_done.is_set() and len(fake.calls) == 2 and app.tx.engine_lock.pins == 2
        assert not third.started.is_set()
        fake.release()
        assert [s.answer(HOLD_S) for s in first] == builtin[:2]
        assert sync_done.wait(HOLD_S) and synced == [True]
        # the sync holds the engine: the third request is still not in SGLang
        assert len(fake.calls) == 2 and not third.done.is_set()
        app.tx.engine_lock.release()
        assert third.answer(HOLD_S) == builtin[2] and len(fake.calls) == 3


def test_a_cancelled_request_leaves_the_concurrent_ones_running(rollout):
    """Two requests are held in SGLang at once; one client goes away: only its SGLang requests are aborted, and
    the other request, released, ends with its full answer (the built-in engine's)."""
    app, ids = rollout
    keep_body = {"prompt": [[3]], "max_tokens": 64, "n": 2, "logprobs": 0}
    with engine_class(app, Scripted, Script(ids)):
        keep_builtin, _ = _answer(app, keep_body, stream=False)
    fake = FakeSglang(scripted(ids, _lps(ids)), hold_at=2, hold_s=HOLD_S, hold_prompt=[3])
    with on_sglang(app, fake):
        keep = _Streamer(app, keep_body)
        _wait_for(lambda: len(fake.calls) == 1 and fake.held.is_set(), "the kept request to be held")
        fake.hold_prompt = [1, 2]  # the next call is held too (the fake reads it as the call comes)
        fake.held.clear()
        gone = _Streamer(app, {"prompt": [[1, 2]], "max_tokens": 64, "n": 2})
        _wait_for(lambda: len(fake.calls) == 2 and fake.held.is_set() and gone.events, "the second request's stream")
        keep_rids, gone_rids = set(fake.calls[0]["rid"]), set(fake.calls[1]["rid"])
        assert gone.started.wait(HOLD_S)
        gone.conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away
        _wait_for(lambda: gone_rids <= fake.finished and app.tx.engine_lock.pins == 1, "the abort", HOLD_S)
        assert set(fake.aborted) == gone_rids and not keep_rids & fake.finished
        assert max(fake.made[r] for r in gone_rids) == 2
        fake.release()
        assert keep.answer(HOLD_S) == keep_builtin and not keep_rids & set(fake.aborted)
