"""The events of a streamed generation (streaming.py) -> server-sent events in OpenAI's chunk format.

A choice's chunks go out as its tokens arrive (incremental.ChoiceText says what text is safe). A
choice ends when the engine marks its last token, when a stop string completes, or at the end of
the generation (an engine that cannot stream sends every token then). At the end every choice is
checked against the answer the same request gets without `stream` (text.finish on the results):
a stream joins to exactly that answer, or ends with an error event instead.
"""

from __future__ import annotations

import json
import logging

from rollout_svc.engine.base import SampleResult
from rollout_svc.openai_api.answers import ChatChunks, CompletionChunks, usage
from rollout_svc.openai_api.incremental import ChoiceText, StreamMismatch
from rollout_svc.openai_api.streaming import Done, Failed, Tokens
from rollout_svc.openai_api.text import Decode, Sample, finish
from weightsync.http.errors import error_payload

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class StreamAnswer:
    """One streamed answer. `render` is called with each batch of events, in order, from one thread at a time."""

    def __init__(
        self,
        chunks: CompletionChunks | ChatChunks,
        n: int,
        decode: Decode | None,
        stops: list[str],
        prompt_tokens: int,
        include_usage: bool,
    ):
        self.chunks, self.n, self.decode, self.stops = chunks, n, decode, stops
        self.prompt_tokens, self.include_usage = prompt_tokens, include_usage
        self.choices: dict[int, ChoiceText] = {}
        self.finals: dict[int, Sample] = {}  # the answer of each choice that ended

    def render(self, events: list) -> tuple[bytes, bool]:
        """(the bytes to send, whether the stream ended): an error after the stream started is a last
        `data: {"error": ...}` event, then `data: [DONE]`, as OpenAI-compatible servers send it."""
        out: list[dict] = []
        try:
            for e in events:
                if isinstance(e, Tokens):
                    self._tokens(e, out)
                elif isinstance(e, Done):
                    self._done(e, out)
                    return b"".join(map(sse, out)) + DONE, True
                elif isinstance(e, Failed):
                    err = e.error
                    out.append(error_payload(err.status, err.message, err.param, err.code))
                    return b"".join(map(sse, out)) + DONE, True
        except StreamMismatch as exc:
            out.append(error_payload(500, str(exc), code="stream_mismatch"))
            return b"".join(map(sse, out)) + DONE, True
        except Exception as exc:  # a bug: the client reads why its stream ended
            log.exception("rendering a stream failed")
            out.append(error_payload(500, f"the stream failed: {type(exc).__name__}: {exc}"))
            return b"".join(map(sse, out)) + DONE, True
        return b"".join(map(sse, out)), False

    def _choice(self, index: int, prompt_index: int, out: list[dict]) -> ChoiceText:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = ChoiceText(index, self.decode, self.stops)
            first = self.chunks.opening(index, prompt_index)
            if first is not None:
                out.append(first)
        return c

    def _add(self, c: ChoiceText, token: int, logprob: float, out: list[dict]) -> None:
        out.append(self.chunks.piece(c.index, c.add(token, logprob), [token], [logprob]))

    def _close(self, c: ChoiceText, final: Sample, out: list[dict]) -> None:
        ids, lps, text = c.close(final)
        self.finals[c.index] = final
        for t, lp in zip(ids[:-1], lps[:-1], strict=True):  # none unless the decode is not incremental
            out.append(self.chunks.piece(c.index, "", [t], [lp]))
        out.append(self.chunks.piece(c.index, text, ids[-1:], lps[-1:], final.finish_reason))

    def _own_answer(self, c: ChoiceText, prompt_index: int, reason: str) -> Sample:
        """The choice's answer from its own tokens, as text.finish makes it (its tokens are all there)."""
        return finish([SampleResult(prompt_index, c.ids, c.logprobs, reason)], self.decode, self.stops)[0]

    def _tokens(self, e: Tokens, out: list[dict]) -> None:
        for tok in e.tokens:
            c = self._choice(e.prompt_index * self.n + tok.sample, e.prompt_index, out)
            if c.closed:  # a stop string ended it (an engine that ignores emit's answer decodes on)
                continue
            self._add(c, tok.token_id, tok.logprob, out)
            if c.stopped or tok.finish_reason is not None:
                self._close(c, self._own_answer(c, e.prompt_index, tok.finish_reason or "stop"), out)

    def _done(self, e: Done, out: list[dict]) -> None:
        if e.version != self.chunks.head.weight_version:  # the pin (serve_turns) makes this impossible
            raise StreamMismatch(
                f"the answer came from version {e.version}, its stream said {self.chunks.head.weight_version}"
            )
        samples = finish(e.results, self.decode, self.stops)  # what the request gets without `stream`
        for k, (r, s) in enumerate(zip(e.results, samples, strict=True)):
            c = self._choice(k, r.prompt_index, out)
            if c.closed:
                final = self.finals[k]
                if (final.token_ids, final.text, final.finish_reason) != (s.token_ids, s.text, s.finish_reason):
                    raise StreamMismatch(
                        f"choice {k}: the stream ended it at token {len(final.token_ids)}, the whole answer at "
                        f"{len(s.token_ids)}; send the request without stream"
                    )
                continue
            # an engine that cannot stream (or a choice still open): its tokens now, one chunk each
            for t, lp in zip(r.token_ids[len(c.ids) :], r.logprobs[len(c.ids) :], strict=True):
                if c.stopped:
                    break
                self._add(c, t, lp, out)
            self._close(c, s, out)
        if self.include_usage:
            out.append(self.chunks.usage(usage(self.prompt_tokens, samples)))
