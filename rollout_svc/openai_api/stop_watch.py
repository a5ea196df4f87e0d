"""Stop strings seen as the engine decodes, so it decodes no further than the answer needs.

An engine that `streams_tokens` asks its emit hook (engine/base.py, Emit) which samples are finished.
`StopWatch` is that hook for a request with stop strings, streamed or not: it follows each choice's
text as incremental.ChoiceText does for a stream and reports a choice once a stop string completes
in it. The answer is still made from the engine's results by text.finish, exactly as from a sample
decoded to its stop token: the cut falls at the first token whose text holds a stop string, and
every token up to it was decoded. A choice is reported only when the decode of all its ids holds a
stop string too (what text.finish cuts on), so a tokenizer whose incremental text differs from its
whole decode costs the saving, never the answer.
"""

from __future__ import annotations

from rollout_svc.engine.base import TokenOut
from rollout_svc.openai_api.incremental import ChoiceText
from rollout_svc.openai_api.text import Decode, first_stop


class StopWatch:
    """emit(prompt_index, tokens) -> the samples of that prompt whose text completed a stop string."""

    def __init__(self, n: int, decode: Decode, stops: list[str]):
        if not stops:
            raise ValueError("StopWatch needs stop strings (without any, pass no emit hook)")
        self.n, self.decode, self.stops = n, decode, stops
        self.choices: dict[int, ChoiceText] = {}  # choices still open
        self.ended: set[int] = set()

    def __call__(self, prompt_index: int, tokens: list[TokenOut]) -> list[int]:
        finished = []
        for tok in tokens:
            k = prompt_index * self.n + tok.sample
            if k in self.ended:
                continue
            c = self.choices.get(k)
            if c is None:
                c = self.choices[k] = ChoiceText(k, self.decode, self.stops)
            c.add(tok.token_id, tok.logprob)
            if c.stopped or tok.finish_reason is not None:
                self.ended.add(k)
                del self.choices[k]  # its text is no longer needed
                if c.stopped and tok.finish_reason is None and first_stop(self.decode(c.ids), self.stops) >= 0:
                    finished.append(tok.sample)
        return finished
