"""Stop strings end decoding early, streamed or not, and a stalled stream reader lends the engine.

A real rollout (built-in engine, tiny-qwen2, a byte-level tokenizer: one token per byte). The answer
with `stop` must be exactly the answer without it, cut by text.cut_at_stop; what changes is how many
decode steps the engine ran (counted by tests/support/counting_model.py, never timed).
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from rollout_svc.engine.base import SamplingParams
from rollout_svc.openai_api.streaming import Channel, Started
from rollout_svc.openai_api.text import cut_at_stop
from tests.support.counting_model import counting
from tests.support.local_apps import start_rollout
from tests.unit.weightsync.http.rest_helpers import TOKEN, byte_level_model
from tests.unit.weightsync.http.test_openai_stream import (
    CHAT_TEMPLATE,
    HOLD_S,
    Joined,
    _events,
    _post_json,
    _post_stream,
)
from weightsync.bus.errors import SyncError

MAX = 40
PROMPT = [[5, 6, 7]]  # more than one token: its prefill is not counted as a decode step


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    from transformers import AutoTokenizer

    path = byte_level_model(tmp_path_factory.mktemp("stop-model"), CHAT_TEMPLATE)
    app = start_rollout("stop-early", model=path, auth_token=TOKEN, serve_initial_weights=True)
    yield app, AutoTokenizer.from_pretrained(path, local_files_only=True)
    app.stop()


def _ask(app, body: dict, stream: bool, path: str = "/v1/completions") -> tuple[dict, dict | None, int]:
    """(choice index -> (ids, log-probs, text, finish_reason), usage, decode steps) of one request."""
    with counting(app.tx.engine) as steps:
        if stream:
            conn, resp = _post_stream(app, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
            events = list(_events(resp))
            conn.close()
            assert events[-1] == "[DONE]"
        else:
            events = [json.loads(_post_json(app, path, body))]
    joined, usage = Joined(), None
    for e in events[:-1] if stream else events:
        usage = e.get("usage") or usage
        for c in e["choices"]:
            if "message" in c:  # a whole chat answer: as one chunk of it
                c = {**c, "delta": {"content": c["message"]["content"]}}
            joined.add(c)
    got = {i: (joined.ids[i], joined.lps[i], joined.text[i], joined.reason[i]) for i in joined.ids}
    return got, usage, steps.decode_steps


def _early_stop(text: str, others: list[str]) -> str:
    """A stop string that starts early in `text` (at its first occurrence) and is in none of `others`."""
    for i in range(1, len(text) // 3):
        s = text[i : i + 2]
        if "\ufffd" not in s and text.find(s) == i and not any(s in o for o in others):
            return s
    raise AssertionError(f"no early stop string in {text!r}")


def _cut(hf, choice: tuple, stops: list[str]) -> tuple:
    """What text.finish makes of a choice decoded to its end: the answer the same request with `stop` must get."""
    ids, lps, text, reason = choice
    cut_ids, cut_lps, cut_text, stopped = cut_at_stop(hf.decode, ids, lps, stops)
    return cut_ids, cut_lps, cut_text, "stop" if stopped else reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_ends_decoding_where_it_completes(rollout, stream):
    app, hf = rollout
    body = {"prompt": PROMPT, "max_tokens": MAX, "temperature": 1.0, "seed": 4, "logprobs": 0}
    full, _, full_steps = _ask(app, body, stream)
    stop = _early_stop(full[0][2], [])
    want = _cut(hf, full[0], [stop])
    got, usage, steps = _ask(app, {**body, "stop": [stop]}, stream)
    assert got[0] == want and want[3] == "stop"
    assert usage["completion_tokens"] == len(want[0])
    # decoded up to the token that completed the stop string: the prefill gave the first token
    assert steps == len(want[0]) - 1 < full_steps


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_one_choice_stops_early_the_other_runs_to_length(rollout, stream):
    app, hf = rollout
    body = {"prompt": PROMPT, "max_tokens": MAX, "temperature": 1.0, "seed": 8, "n": 2, "logprobs": 0}
    full, full_usage, full_steps = _ask(app, body, stream)
    stop = _early_stop(full[0][2], [full[1][2]])
    decoded = app.servicer.rollout_metrics.completion_tokens.labels("rollout", "http_completions")
    before = decoded._value.get()
    got, usage, steps = _ask(app, {**body, "stop": [stop]}, stream)
    assert got == {0: _cut(hf, full[0], [stop]), 1: full[1]}
    assert got[0][3] == "stop" and len(got[0][0]) < len(full[0][0])
    assert usage["completion_tokens"] == len(got[0][0]) + len(full[1][0])
    assert steps == full_steps  # the other choice still decodes to its end
    # the engine decoded choice 0 no further than the token that completed its stop string
    assert decoded._value.get() - before == len(got[0][0]) + len(full[1][0])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_with_a_stop_string_is_the_cut_answer(rollout, stream):
    """Chat decodes without special tokens; its watch decodes as its answer does, so the cut is the same."""
    app, hf = rollout
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX, "temperature": 1.0, "seed": 2}
    body["logprobs"] = True
    full, _, full_steps = _ask(app, body, stream, "/v1/chat/completions")
    stop = _early_stop(full[0][2], [])
    got, usage, steps = _ask(app, {**body, "stop": stop}, stream, "/v1/chat/completions")
    want = _cut(hf, full[0], [stop])
    assert got[0] == want and usage["completion_tokens"] == len(want[0])
    assert steps == len(want[0]) - 1 < full_steps


# ---- a stalled stream reader lends the engine -----------------------------------------------------
def test_a_stalled_reader_lets_other_requests_run(rollout):
    """A stream whose reader takes nothing (a channel of one event, never read) waits for room with
    the engine lent: a second request runs to its end meanwhile, the stalled one is not cancelled for
    it, and it goes on (taking a turn again) once there is room."""
    app, _ = rollout
    loop = asyncio.new_event_loop()
    ch = Channel(loop, capacity=1, stall_s=HOLD_S)
    emitted = threading.Semaphore(0)  # released at each decode step's emit, before its put
    failure: list[SyncError] = []

    def started(version, lend):
        ch.lend = lend
        ch.put(Started(version))  # the channel's only room

    def emit(pi, toks):
        emitted.release()
        ch.put(toks)  # no room: waits for the reader

    def stalled():
        try:
            app.servicer.generate(
                [[1, 2, 3]],
                SamplingParams(max_new_tokens=MAX),
                "stalled-reader",
                is_active=lambda: not ch.closed.is_set(),
                emit=emit,
                on_start=started,
            )
        except SyncError as exc:
            failure.append(exc)

    producer = threading.Thread(target=stalled, daemon=True)
    producer.start()
    try:
        assert emitted.acquire(timeout=HOLD_S), "the stalled request never emitted"
        # its first tokens wait for room (HOLD_S at most); the engine is another request's meanwhile
        results, _ = app.servicer.generate([[4, 5, 6]], SamplingParams(max_new_tokens=4), "other")
        assert len(results[0].token_ids) == 4
        assert producer.is_alive() and not ch.closed.is_set() and not failure  # it waited, not cancelled
        assert not emitted.acquire(blocking=False)  # and decoded nothing further without room
        # room again: the stalled request takes a turn, puts its tokens and decodes its next step
        assert loop.run_until_complete(ch.get(HOLD_S))
        assert emitted.acquire(timeout=HOLD_S), "the request did not go on once there was room"
    finally:
        ch.closed.set()  # the reader goes: the request stops within a poll
        producer.join(HOLD_S)
        loop.close()
    assert not producer.is_alive() and failure and failure[0].code == "CANCELLED"
    assert not app.tx.engine_lock.locked()
