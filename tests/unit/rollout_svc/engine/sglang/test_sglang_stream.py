"""The SGLang adapter's token streaming (`generate(emit=)`, rollout_svc/engine/sglang_stream.py), on CPU.

tests/support/fake_sglang.py stands in for SGLang's Engine: its streamed items are cumulative and its
aborts must run on Engine.loop, as in SGLang 0.5.10 / 0.5.23 (the keywords the adapter passes are
checked against the real wheels by test_sglang_contract.py).
"""

from __future__ import annotations

import pytest

from rollout_svc.engine.base import SamplingParams, TokenOut
from tests.support.fake_sglang import FakeSglang, adapter_on, scripted

IDS = [11, 12, 13, 14, 15, 16]
LPS = [-0.5 - j / 8 for j in range(len(IDS))]


class Emits:
    """An emit hook that records its calls and ends sample `stop_sample` of prompt `stop_prompt` at token `stop_at`."""

    def __init__(self, stop_at: int | None = None, stop_prompt: int = 0, stop_sample: int = 0, raise_at: int = -1):
        self.calls: list[tuple[int, list[TokenOut]]] = []
        self.stop_at, self.stop_prompt, self.stop_sample, self.raise_at = stop_at, stop_prompt, stop_sample, raise_at

    def __call__(self, prompt_index: int, tokens: list[TokenOut]):
        self.calls.append((prompt_index, tokens))
        if len(self.calls) == self.raise_at:
            raise ConnectionAbortedError("the stream's reader went away")
        seen = [t for p, (t,) in self.calls if (p, t.sample) == (prompt_index, tokens[0].sample)]
        if (prompt_index, tokens[0].sample) == (self.stop_prompt, self.stop_sample) and len(seen) == self.stop_at:
            return [self.stop_sample]
        return None

    def of(self, prompt_index: int, sample: int) -> list[TokenOut]:
        return [t for p, ts in self.calls for t in ts if (p, t.sample) == (prompt_index, sample)]


@pytest.mark.parametrize("per_item", [1, 4], ids=["token-per-item", "coalesced-items"])
def test_tokens_reach_emit_one_by_one_as_sglang_streams_them(per_item):
    fake = FakeSglang(scripted(IDS, LPS), per_item=per_item)
    eng = adapter_on(fake)
    emit = Emits()
    res = eng.generate([[1, 2], [3]], SamplingParams(max_new_tokens=6, n=2), emit=emit)
    (call,) = fake.calls
    assert call["stream"] is True and call["return_logprob"] is True and len(set(call["rid"])) == 4
    assert all(len(ts) == 1 for _, ts in emit.calls)  # a sample's tokens one per call, even from one item
    for pi in (0, 1):
        for r in (0, 1):
            got = emit.of(pi, r)
            assert [t.token_id for t in got] == IDS and [t.logprob for t in got] == LPS
            assert [t.finish_reason for t in got] == [None] * 5 + ["length"]
    assert [(x.prompt_index, x.token_ids, x.logprobs, x.finish_reason) for x in res] == [
        (pi, IDS, LPS, "length") for pi in (0, 0, 1, 1)
    ]
    assert not fake.aborted


def test_streamed_results_equal_the_whole_answer_and_a_stop_token_says_stop():
    fake = FakeSglang(scripted(IDS, LPS, finish="stop"))
    eng = adapter_on(fake)
    whole = eng.generate([[1, 2]], SamplingParams(max_new_tokens=8, n=2))
    streamed = eng.generate([[1, 2]], SamplingParams(max_new_tokens=8, n=2), emit=Emits())
    assert [fake.calls[0]["stream"], fake.calls[1]["stream"]] == [False, True]
    assert streamed == whole and {r.finish_reason for r in streamed} == {"stop"}


def test_a_sample_emit_ends_is_aborted_in_sglang_and_ends_at_that_token():
    fake = FakeSglang(scripted(IDS, LPS))
    eng = adapter_on(fake)
    emit = Emits(stop_at=2, stop_prompt=1, stop_sample=1)
    res = eng.generate([[1], [2]], SamplingParams(max_new_tokens=6, n=2), emit=emit)
    rids = fake.calls[0]["rid"]
    assert fake.aborted == [rids[3]]  # prompt 1's sample 1 only, on SGLang's loop (the fake asserts it)
    assert fake.made[rids[3]] == 2  # SGLang decoded no further: the abort landed before its next step
    assert [len(t) for t in (emit.of(1, 1), res[3].token_ids)] == [2, 2]
    assert (res[3].token_ids, res[3].logprobs, res[3].finish_reason) == (IDS[:2], LPS[:2], "stop")
    assert [(r.token_ids, r.finish_reason) for r in res[:3]] == [(IDS, "length")] * 3  # the others ran on


def test_a_failing_emit_aborts_every_request_and_is_raised_once_sglang_is_done():
    fake = FakeSglang(scripted(IDS, LPS))
    eng = adapter_on(fake)
    emit = Emits(raise_at=3)
    with pytest.raises(ConnectionAbortedError, match="reader went away"):
        eng.generate([[1]], SamplingParams(max_new_tokens=6, n=2), emit=emit)
    assert sorted(fake.aborted) == sorted(fake.calls[0]["rid"]) and fake.finished == set(fake.aborted)
    assert len(emit.calls) == 3  # emit is called no more once it raised
    assert max(fake.made.values()) < len(IDS)  # neither request ran to its end


def test_a_cancelled_stream_aborts_its_requests_and_raises_the_cancellation():
    """The service's cancellation check (`step`) while SGLang holds the stream: the watcher aborts every
    request on SGLang's loop, the held engine wakes to finish them, and the cancellation is raised."""

    class Gone(Exception):
        pass

    fake = FakeSglang(scripted(IDS, LPS), hold_at=2)
    eng = adapter_on(fake)

    def step():
        if fake.held.is_set():
            raise Gone("client went away")

    emit = Emits()
    with pytest.raises(Gone):
        eng.generate([[1], [2]], SamplingParams(max_new_tokens=6), step=step, emit=emit)
    assert sorted(fake.aborted) == sorted(fake.calls[0]["rid"]) and fake.finished == set(fake.aborted)
    assert [len(emit.of(p, 0)) for p in (0, 1)] == [2, 2] and set(fake.made.values()) == {2}


def test_an_abort_sglang_made_itself_is_an_error():
    def answer(k, prompt, params):
        return IDS[:2], LPS[:2], "abort"

    eng = adapter_on(FakeSglang(answer))
    with pytest.raises(RuntimeError, match="sglang aborted the request for prompt 0"):
        eng.generate([[1]], SamplingParams(max_new_tokens=6), emit=Emits())
