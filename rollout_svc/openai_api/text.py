"""Token ids -> the text of an answer: stop strings, and the incremental decode a stream sends.

A stop string is applied to the finished sample: it is cut after the first token whose text
completes a stop string, and its text ends just before that string (OpenAI's rule: the stop string
itself is not returned). The engine may have stopped that sample there already (stop_watch.py) or
decoded on to a stop token; the cut is the same. `token_ids` and `logprobs` are cut
at the same token, so an RL caller still gets exactly the tokens whose text it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Decode = Callable[[list[int]], str]


@dataclass
class Sample:
    """One finished choice, as the surface reports it."""

    index: int
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


def first_stop(text: str, stops: list[str]) -> int:
    """Where the first stop string in `text` starts, -1 for none."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def cut_at_stop(
    decode: Decode, ids: list[int], logprobs: list[float], stops: list[str]
) -> tuple[list[int], list[float], str, bool]:
    """(ids, logprobs, text, stopped): cut at the first token whose text contains a stop string."""
    text = decode(ids)
    if not stops or first_stop(text, stops) < 0:
        return ids, logprobs, text, False
    # The shortest prefix whose text holds a stop string (log2(len) decodes; the whole holds one).
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(decode(ids[:mid]), stops) >= 0:
            hi = mid
        else:
            lo = mid + 1
    text = decode(ids[:lo])
    return ids[:lo], logprobs[:lo], text[: first_stop(text, stops)], True


class Detokenizer:
    """Incremental detokenization as vLLM does it: decode a short window ending at the newest token
    and give what it adds to the window before it, holding back an incomplete UTF-8 character
    (U+FFFD at the end) until its last byte arrives. For the tokenizers in use (byte-level BPE,
    SentencePiece, word-level) the pieces join to the decode of all the ids, less a held-back tail."""

    def __init__(self, decode: Decode):
        self.decode, self.ids, self.start, self.read = decode, [], 0, 0

    def push(self, token: int) -> str:
        """The text `token` completes ("" while it holds back)."""
        ids = self.ids
        ids.append(token)
        before, now = self.decode(ids[self.start : self.read]), self.decode(ids[self.start :])
        if len(now) > len(before) and now.startswith(before) and not now.endswith("\ufffd"):
            self.start, self.read = self.read, len(ids)
            return now[len(before) :]
        return ""


def finish(results, decode: Decode | None, stops: list[str]) -> list[Sample]:
    """The engine's results -> samples, stop strings applied (they need `decode`; the caller checks)."""
    out = []
    for i, r in enumerate(results):
        ids, lps, reason = list(r.token_ids), list(r.logprobs), r.finish_reason
        text = ""
        if decode is not None:
            ids, lps, text, stopped = cut_at_stop(decode, ids, lps, stops)
            reason = "stop" if stopped else reason
        out.append(Sample(i, r.prompt_index, ids, lps, text, reason))
    return out
