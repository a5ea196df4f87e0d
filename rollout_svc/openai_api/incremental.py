"""One choice of a stream as its tokens arrive: the text that is safe to send, and where it ends.

Ids and log-probs go out with their token: a stop string only ever cuts after the token that
completes it, so every token a choice takes is part of its final answer. Text is held back while
it may still change: an incomplete UTF-8 character (text.Detokenizer) and the longest tail that
could be the start of a stop string. Once a stop string completes, the choice takes no more tokens
and its text ends before it. `close` checks the whole against the answer the non-stream path gives
(text.finish) and returns what is left to send, so a stream joins to exactly that answer.
"""

from __future__ import annotations

from rollout_svc.openai_api.stop_match import StopTracker
from rollout_svc.openai_api.text import Decode, Detokenizer, Sample, first_stop


class StreamMismatch(Exception):
    """What was streamed is not a prefix of the finished answer (a tokenizer whose decode is not
    incremental); the stream ends with an error event rather than a wrong text."""


class ChoiceText:
    """The tokens of one choice, added one by one; `add` returns the text they make safe to send."""

    def __init__(self, index: int, decode: Decode | None, stops: list[str]):
        self.index, self.stops = index, stops
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.det = Detokenizer(decode) if decode is not None else None
        self.text = ""  # the complete characters decoded so far
        self.sent = 0  # how much of `text` went out
        self.stopped = False  # a stop string completed: the choice takes no more tokens
        self.closed = False
        self._tracker = StopTracker(stops) if stops and decode is not None else None

    def add(self, token: int, logprob: float) -> str:
        self.ids.append(token)
        self.logprobs.append(logprob)
        if self.det is None:
            return ""
        before = len(self.text)
        new = self.det.push(token)
        self.text += new
        end = len(self.text)
        if self.stops:
            # only the new characters move the automaton (stop_match.py): linear in the text
            if self._tracker.feed(new):
                # a stop string that ends in the new text starts at most (longest stop - 1) chars before it
                scan = max(0, before - max(map(len, self.stops)) + 1)
                self.stopped, end = True, scan + first_stop(self.text[scan:], self.stops)
            else:
                end -= self._tracker.held
        piece = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return piece

    def close(self, final: Sample) -> tuple[list[int], list[float], str]:
        """(ids, log-probs, text) of `final` (the finished answer of this choice) not sent yet."""
        self.closed = True
        n, sent = len(self.ids), self.text[: self.sent]
        if final.token_ids[:n] != self.ids or (self.stopped and len(final.token_ids) != n):
            raise StreamMismatch(
                f"choice {self.index}: the streamed token ids ({n}) are not those of the finished answer "
                f"({len(final.token_ids)}); send the request without stream"
            )
        if not final.text.startswith(sent):
            raise StreamMismatch(
                f"choice {self.index}: the tokenizer's incremental decode differs from its decode of the whole "
                "answer (the streamed text would not join to it); send the request without stream"
            )
        return final.token_ids[n:], final.logprobs[n:], final.text[len(sent) :]
