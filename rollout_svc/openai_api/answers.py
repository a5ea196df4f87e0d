"""Finished samples -> OpenAI's answer objects and stream chunks, for completions and chat.

Every object carries `weight_version`. Without a tokenizer (completions with token ids only),
texts are "" and a token's `tokens` entry is its id as a string. Streams are built from finished
samples (see routes.py): one chunk per token and choice, then one with the choice's
finish_reason, then (stream_options.include_usage) one with `usage` and no choices.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from rollout_svc.openai_api.text import Decode, Sample, token_pieces


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


def completion_chunks(
    head: Head,
    samples: list[Sample],
    decode: Decode | None,
    logprobs: bool,
    echo: list[str] | None,
    usage_of: dict | None,
) -> Iterator[dict]:
    def chunk(index, text, ids, lps, reason=None):
        lp = _completion_logprobs(decode, ids, lps) if logprobs and ids else None
        return head.obj(
            "text_completion",
            choices=[{"index": index, "text": text, "token_ids": ids, "logprobs": lp, "finish_reason": reason}],
        )

    for s in samples:
        if echo:
            yield chunk(s.index, echo[s.prompt_index], [], [])
        pieces = token_pieces(decode, s.token_ids, s.text) if decode is not None else [""] * len(s.token_ids)
        for t, lp, piece in zip(s.token_ids, s.logprobs, pieces, strict=True):
            yield chunk(s.index, piece, [t], [lp])
        yield chunk(s.index, "", [], [], s.finish_reason)
    if usage_of is not None:
        yield head.obj("text_completion", choices=[], usage=usage_of)


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


def chat_chunks(
    head: Head, samples: list[Sample], decode: Decode, logprobs: bool, usage_of: dict | None
) -> Iterator[dict]:
    def chunk(index, delta, ids, lps, reason=None):
        lp = _chat_logprobs(decode, ids, lps) if logprobs and ids else None
        return head.obj(
            "chat.completion.chunk",
            choices=[{"index": index, "delta": delta, "token_ids": ids, "logprobs": lp, "finish_reason": reason}],
        )

    for s in samples:
        yield chunk(s.index, {"role": "assistant", "content": ""}, [], [])
        for t, lp, piece in zip(s.token_ids, s.logprobs, token_pieces(decode, s.token_ids, s.text), strict=True):
            yield chunk(s.index, {"content": piece}, [t], [lp])
        yield chunk(s.index, {}, [], [], s.finish_reason)
    if usage_of is not None:
        yield head.obj("chat.completion.chunk", choices=[], usage=usage_of)
