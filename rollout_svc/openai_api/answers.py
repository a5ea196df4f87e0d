"""Finished samples -> OpenAI's answer objects and stream chunks, for completions and chat.

Every object carries `weight_version`. Without a tokenizer (completions with token ids only),
texts are "" and a token's `tokens` entry is its id as a string. A stream's chunks (built as its
tokens arrive: stream_answer.py) are one per token and choice, each with the text that token made
safe to send; then one per choice with its finish_reason and any text held back until the end;
then (stream_options.include_usage) one with `usage` and no choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_svc.openai_api.text import Decode, Sample


@dataclass
class Head:
    """The fields every object of one answer shares."""

    id: str
    created: int
    model: str
    weight_version: int

    def obj(self, kind: str, **fields) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            **fields,
            "weight_version": self.weight_version,
        }


def usage(prompt_tokens: int, samples: list[Sample]) -> dict:
    done = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}


def _token_strings(decode: Decode | None, ids: list[int]) -> list[str]:
    return [decode([t]) if decode is not None else str(t) for t in ids]


def _completion_logprobs(decode: Decode | None, ids: list[int], lps: list[float]) -> dict:
    return {"tokens": _token_strings(decode, ids), "token_logprobs": lps, "top_logprobs": None, "text_offset": None}


def _chat_logprobs(decode: Decode, ids: list[int], lps: list[float]) -> dict:
    return {
        "content": [
            {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
            for s, lp in zip(_token_strings(decode, ids), lps, strict=True)
        ]
    }


# ---- completions ----------------------------------------------------------------------------
def completion_choices(
    samples: list[Sample], decode: Decode | None, logprobs: bool, echo: list[str] | None
) -> list[dict]:
    return [
        {
            "index": s.index,
            "text": (echo[s.prompt_index] if echo else "") + s.text,
            "token_ids": s.token_ids,
            "logprobs": _completion_logprobs(decode, s.token_ids, s.logprobs) if logprobs else None,
            "finish_reason": s.finish_reason,
        }
        for s in samples
    ]


class CompletionChunks:
    """The chunks of a streamed completion."""

    def __init__(self, head: Head, decode: Decode | None, logprobs: bool, echo: list[str] | None):
        self.head, self.decode, self.logprobs, self.echo = head, decode, logprobs, echo

    def piece(self, index: int, text: str, ids: list[int], lps: list[float], reason: str | None = None) -> dict:
        lp = _completion_logprobs(self.decode, ids, lps) if self.logprobs and ids else None
        return self.head.obj(
            "text_completion",
            choices=[{"index": index, "text": text, "token_ids": ids, "logprobs": lp, "finish_reason": reason}],
        )

    def opening(self, index: int, prompt_index: int) -> dict | None:
        return self.piece(index, self.echo[prompt_index], [], []) if self.echo else None

    def usage(self, usage_of: dict) -> dict:
        return self.head.obj("text_completion", choices=[], usage=usage_of)


# ---- chat -----------------------------------------------------------------------------------
def chat_choices(samples: list[Sample], decode: Decode, logprobs: bool) -> list[dict]:
    return [
        {
            "index": s.index,
            "message": {"role": "assistant", "content": s.text},
            "token_ids": s.token_ids,
            "logprobs": _chat_logprobs(decode, s.token_ids, s.logprobs) if logprobs else None,
            "finish_reason": s.finish_reason,
        }
        for s in samples
    ]


class ChatChunks:
    """The chunks of a streamed chat completion."""

    def __init__(self, head: Head, decode: Decode, logprobs: bool):
        self.head, self.decode, self.logprobs = head, decode, logprobs

    def _chunk(self, index: int, delta: dict, ids: list[int], lps: list[float], reason: str | None) -> dict:
        lp = _chat_logprobs(self.decode, ids, lps) if self.logprobs and ids else None
        return self.head.obj(
            "chat.completion.chunk",
            choices=[{"index": index, "delta": delta, "token_ids": ids, "logprobs": lp, "finish_reason": reason}],
        )

    def piece(self, index: int, text: str, ids: list[int], lps: list[float], reason: str | None = None) -> dict:
        return self._chunk(index, {"content": text} if text or ids else {}, ids, lps, reason)

    def opening(self, index: int, prompt_index: int) -> dict:
        return self._chunk(index, {"role": "assistant", "content": ""}, [], [], None)

    def usage(self, usage_of: dict) -> dict:
        return self.head.obj("chat.completion.chunk", choices=[], usage=usage_of)
