"""Issue 49: following stop strings costs time linear in the generated text.

16 long stop strings made tripling the tokens 9x slower: every token searched every tail of the
last (longest stop) characters. Timed in one run against itself, so the machine's speed cancels: 3x
the tokens must cost at most ~4x the time, for text that never starts a stop string and for text
that keeps matching the start of all of them. The automaton agrees with the plain definition.
"""

from __future__ import annotations

import gc
import random
import statistics
import time

import pytest

from rollout_svc.engine.base import TokenOut
from rollout_svc.openai_api.incremental import ChoiceText
from rollout_svc.openai_api.stop_match import StopTracker
from rollout_svc.openai_api.stop_watch import StopWatch
from rollout_svc.openai_api.text import first_stop

STOP_CHARS = 1024  # MAX_STOP_CHARS
#: 16 long stops that share a long start ("ab" repeated) and differ only at their end
STOPS = [("ab" * STOP_CHARS)[: STOP_CHARS - 1] + chr(ord("A") + i) for i in range(16)]


def _decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def _run(text: str) -> float:
    watch = StopWatch(1, _decode, STOPS)
    gc.disable()  # a collection landing in one run and not the other is not the matching's cost
    try:
        t0 = time.process_time()  # CPU time: other processes on the machine do not count
        for ch in text:
            assert watch(0, [TokenOut(0, ord(ch), 0.0, None)]) == []
        return time.process_time() - t0
    finally:
        gc.enable()


@pytest.mark.serial
@pytest.mark.parametrize("pattern", ["zy", "ab"], ids=["never-a-stop", "always-a-stop-start"])
def test_three_times_the_tokens_cost_at_most_about_four_times_the_time(pattern):
    n = 900  # text shorter than the stops: where the tail search grew with the square of the text
    _run(pattern * (n // 2))  # builds the cached automaton
    runs = [(_run(pattern * (n // 2)), _run(pattern * (3 * n // 2))) for _ in range(7)]  # interleaved
    small, big = (statistics.median(r) for r in zip(*runs))
    assert big <= 4 * small, (small, big, big / small)


def _held_back(text: str, stops: list[str]) -> int:
    """The definition: the longest tail of `text` that is the start of a stop string (not all of one)."""
    for n in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


def test_the_automaton_holds_back_and_stops_exactly_as_the_definition():
    rng = random.Random(0)
    for _ in range(200):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        text, tracker = "", StopTracker(stops)
        for _ in range(30):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 2)))
            before = len(text)
            text += piece
            hit = tracker.feed(piece)
            scan = max(0, before - max(map(len, stops)) + 1)
            assert hit == (first_stop(text[scan:], stops) >= 0), (stops, text)
            if hit:
                break
            assert tracker.held == _held_back(text, stops), (stops, text)


def test_a_stream_cuts_before_the_earliest_starting_stop():
    c = ChoiceText(0, _decode, ["abcd", "bc"])
    sent = "".join(c.add(ord(ch), 0.0) for ch in "xxabcd")
    assert c.stopped and sent == "xxa"  # "bc" completed first; the text ends before it


def test_a_stop_string_over_max_stop_chars_is_refused_naming_the_field():
    from rollout_svc.openai_api.routes import _stops
    from rollout_svc.openai_api.schemas import MAX_STOP_CHARS
    from weightsync.http.errors import ApiError

    assert _stops(STOPS) == STOPS and len(STOPS[0]) == MAX_STOP_CHARS
    with pytest.raises(ApiError, match=f"stop: each string at most {MAX_STOP_CHARS} characters, got one of 1025"):
        _stops(["x", "y" * (MAX_STOP_CHARS + 1)])
