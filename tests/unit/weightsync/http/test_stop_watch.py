"""StopWatch alone: which samples the engine is told to end, per prompt, on bytes as tokens."""

from __future__ import annotations

import pytest

from rollout_svc.engine.base import TokenOut
from rollout_svc.openai_api.stop_watch import StopWatch


def _decode(ids: list[int]) -> str:
    return bytes(ids).decode(errors="replace")


def _step(text: str, j: int, n: int, last: str | None = None) -> list[TokenOut]:
    """The j-th byte of `text` as every one of n samples' token."""
    return [TokenOut(r, text.encode()[j], -0.5, last) for r in range(n)]


def test_a_sample_is_ended_at_the_token_that_completes_a_stop_string():
    watch, text = StopWatch(2, _decode, ["</a>", "zz"]), "ok</a>more"
    ended = [(j, watch(1, _step(text, j, 2))) for j in range(len(text))]
    # both samples of prompt 1 end at ">" (index 5), never before, and are not reported again
    assert [(j, e) for j, e in ended if e] == [(5, [0, 1])]
    assert watch.choices == {} and watch.ended == {2, 3}  # choice index = prompt * n + sample


def test_samples_of_one_step_end_apart_and_a_finished_sample_is_not_reported():
    watch = StopWatch(2, _decode, ["b"])
    assert watch(0, [TokenOut(0, ord("a"), 0.0, None), TokenOut(1, ord("b"), 0.0, None)]) == [1]
    assert watch(0, [TokenOut(0, ord("b"), 0.0, "length")]) == []  # the engine ended it itself


def test_a_stop_string_the_whole_decode_does_not_hold_is_not_reported():
    """A tokenizer whose incremental text shows a stop string that the decode of all the ids does not
    (here: longer decodes drop "X"): text.finish would not cut there, so the engine must decode on."""

    def decode(ids):
        s = _decode(ids)
        return s if len(ids) < 6 else s.replace("X", "")

    watch, text = StopWatch(1, decode, ["X"]), "abcdeXfg"
    assert not any(watch(0, _step(text, j, 1)) for j in range(len(text)))


def test_no_stop_strings_is_no_watch():
    with pytest.raises(ValueError, match="stop strings"):
        StopWatch(1, _decode, [])
