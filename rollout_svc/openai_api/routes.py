"""The OpenAI routes of a rollout: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

The token is checked before a route runs (weightsync/http/auth.py); errors are OpenAI's error body
(weightsync/http/errors.py).

Streams (`stream: true`) send tokens as they are decoded on an engine that `streams_tokens` (the
built-in engine: every decode step's tokens, per choice; the SGLang adapter: each token as SGLang's
streaming generate hands it over); on one that does not, the whole answer is generated first and then
sent one chunk per token. Either way a stream is exact: its text, ids and log-probs join to
those of the same request without `stream` (checked at its end), text that may still be part of a
stop string or of a character split across tokens is held back, and X-Weight-Version is the version
the engine pinned for the request before its first step. The response starts once the first tokens
(or the whole answer) exist, so a request refused or invalid before then is an ordinary HTTP error;
a failure after that is a last `data: {"error": ...}` event, then `data: [DONE]`. A client that
disconnects, or reads nothing for streaming.STALL_S, stops the generation at its next step (SGLang:
its requests are aborted in SGLang's scheduler); while a stream's reader has no room, other requests
take turns on an engine that takes turns (the built-in one).

Stop strings: the answer is cut after the first token whose text holds one (text.py). On an engine
that `streams_tokens` (both) a choice is also decoded no further than that token, streamed or not
(stop_watch.py): the answer is the same, fewer tokens are decoded, and a stream ends as soon as its
last choice hits a stop string. An engine that does not stream decodes each choice to a stop token or
max_tokens, and the answer is cut after.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from rollout_svc.openai_api import answers
from rollout_svc.openai_api.generation import check_ranges, generate, sampling_params
from rollout_svc.openai_api.schemas import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from rollout_svc.openai_api.stop_watch import StopWatch
from rollout_svc.openai_api.stream_answer import StreamAnswer
from rollout_svc.openai_api.streaming import StreamRun
from rollout_svc.openai_api.text import finish
from rollout_svc.openai_api.tokenizer import ModelTokenizer
from weightsync.http.errors import ApiError


@dataclass
class Served:
    """What the routes serve: the model id clients name, and the bounds of a default max_tokens."""

    model: str
    version: Callable[[], int]
    max_new_tokens: int  # the rollout's limits.max_new_tokens
    context_length: int | None = None  # the model's positions (prompt + completion), when known


_ERRORS = {
    400: {"description": "invalid request (the message names the field)"},
    404: {"description": "not the served model (GET /v1/models)"},
    429: {"description": "too many requests in flight (this client's share or the rollout's); retry"},
    503: {"description": "engine busy applying weights, STALE, or not ready; retry"},
}
_STREAM = {
    200: {
        "content": {"text/event-stream": {}},
        "description": "the answer; with `stream: true`, server-sent events ending with `data: [DONE]`",
    }
}


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise ApiError(400, f"stop: give at most {MAX_STOP_STRINGS} non-empty strings, got {stops!r}"[:300], "stop")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:  # the automaton a request builds grows with them (stop_match.py)
        raise ApiError(400, f"stop: each string at most {MAX_STOP_CHARS} characters, got one of {longest}", "stop")
    return stops


class _Routes:
    """The handlers of one rollout's OpenAI surface (registered by `rollout_router`)."""

    def __init__(self, servicer, served: Served):
        self.servicer, self.served = servicer, served
        self.tokenizer = ModelTokenizer(served.model)
        self.created = int(time.time())

    def card(self) -> ModelCard:
        s = self.served
        return ModelCard(id=s.model, created=self.created, root=s.model, weight_version=s.version())

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served.model:
            raise ApiError(
                404,
                f"model: {name!r} is not served here; this rollout serves {self.served.model!r} (GET /v1/models)",
                "model",
                "model_not_found",
            )

    def head(self, prefix: str, version: int) -> answers.Head:
        return answers.Head(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.served.model, version)

    def models(self):
        return ModelList(data=[self.card()])

    def model(self, model_id: str):
        self.check_model(model_id)
        return self.card()

    async def completions(self, body: CompletionRequest, request: Request, response: Response):
        self.check_model(body.model)
        if body.logprobs is not None and not 0 <= body.logprobs <= 5:
            raise ApiError(400, f"logprobs={body.logprobs} must be in [0, 5]", "logprobs")
        if body.echo and body.logprobs is not None:
            raise ApiError(
                400,
                "echo: not with logprobs (the prompt's log-probs are not computed); use the gRPC Score call for them",
                "echo",
            )
        stops = _stops(body.stop)
        sampling = sampling_params(body, body.max_tokens)
        tokenizer = self.tokenizer

        def prepare():
            if stops:
                tokenizer.require("stop", "stop strings", "use stop_token_ids")  # loads it: get() is quick
            p = body.prompt
            if isinstance(p, str) or (p and isinstance(p[0], str)):
                texts = [p] if isinstance(p, str) else list(p)
                return tokenizer.encode_texts(texts), texts
            ids = [list(p)] if p and isinstance(p[0], int) else [list(x) for x in p]
            tok = tokenizer.get() if body.echo else None
            return ids, [tok.decode(x) if tok is not None else "" for x in ids]

        prompts, prompt_texts = await anyio.to_thread.run_sync(prepare)
        echo = prompt_texts if body.echo else None
        logprobs = body.logprobs is not None
        if body.stream:
            tok = await anyio.to_thread.run_sync(tokenizer.get)
            decode = tok.decode if tok is not None else None

            def streamed(h: answers.Head) -> StreamAnswer:
                chunks = answers.CompletionChunks(h, decode, logprobs, echo)
                return StreamAnswer(chunks, body.n, decode, stops, sum(map(len, prompts)), _usage_asked(body))

            watch = StopWatch(body.n, decode, stops) if stops else None
            return await self._stream(request, prompts, sampling, "http_completions", "cmpl", streamed, watch)
        watch = StopWatch(body.n, tokenizer.get().decode, stops) if stops else None
        results, version = await generate(self.servicer, request, prompts, sampling, "http_completions", watch)

        def answer():
            tok = tokenizer.get()
            decode = tok.decode if tok is not None else None
            samples = finish(results, decode, stops)
            use = answers.usage(sum(map(len, prompts)), samples)
            return self.head("cmpl", version).obj(
                "text_completion", choices=answers.completion_choices(samples, decode, logprobs, echo), usage=use
            )

        out = await anyio.to_thread.run_sync(answer)  # decoding is CPU work: off the event loop
        response.headers["X-Weight-Version"] = str(version)
        return out

    async def _stream(self, request: Request, prompts, sampling, endpoint: str, prefix: str, streamed, watch):
        """The SSE response of a streamed request; `streamed(head)` builds its StreamAnswer; `watch`
        (stop strings) stops choices early."""
        run = StreamRun(self.servicer, request, prompts, sampling, endpoint, watch)
        try:
            version, first = await run.opening()  # an error before the first token is raised here
        except BaseException:
            run.close()
            raise
        answer = streamed(self.head(prefix, version))

        async def body():
            try:
                events = first
                while True:
                    data, ended = await anyio.to_thread.run_sync(answer.render, events)  # decoding: off the loop
                    if data:
                        yield data
                    if ended:
                        return
                    events = await run.events()
            finally:
                run.close()  # the client went away mid-stream: the generation stops at its next step

        headers = {"X-Weight-Version": str(version), "Cache-Control": "no-cache"}
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    def _chat_length(self, body: ChatCompletionRequest) -> int | None:
        """The completion budget a chat request asks for (None: the model's room), checked."""
        if body.top_logprobs:
            raise ApiError(
                400,
                f"top_logprobs={body.top_logprobs}: only 0 is supported (the engine reports the "
                "sampled token's log-prob; set logprobs: true)",
                "top_logprobs",
            )
        if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
            raise ApiError(
                400,
                f"max_tokens={body.max_tokens} and max_completion_tokens={body.max_completion_tokens} "
                "disagree; send one of them",
                "max_completion_tokens",
            )
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        check_ranges(max_completion_tokens=asked)
        return asked

    async def chat(self, body: ChatCompletionRequest, request: Request, response: Response):
        self.check_model(body.model)
        asked = self._chat_length(body)
        stops = _stops(body.stop)
        messages = []
        for m in body.messages:
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):  # text parts are joined, as vLLM does for text-only models
                d["content"] = "\n".join(part.text for part in m.content)
            messages.append(d)
        prompt = await anyio.to_thread.run_sync(self.tokenizer.chat_prompt, messages, body.add_generation_prompt)
        if not prompt:
            raise ApiError(400, "messages: the chat template rendered them to no tokens", "messages")
        served = self.served
        if asked is None:  # OpenAI's default: the rest of the context; here also within the rollout's limit
            room = served.context_length - len(prompt) if served.context_length else served.max_new_tokens
            asked = max(1, min(served.max_new_tokens, room))
        sampling = sampling_params(body, asked)
        tok = self.tokenizer.get()  # loaded by chat_prompt

        def decode(ids):  # the message's text: the end-of-turn token is not part of it
            return tok.decode(ids, skip_special_tokens=True)

        watch = StopWatch(body.n, decode, stops) if stops else None  # the engine's emit hook: stop early
        if body.stream:

            def streamed(h: answers.Head) -> StreamAnswer:
                chunks = answers.ChatChunks(h, decode, body.logprobs)
                return StreamAnswer(chunks, body.n, decode, stops, len(prompt), _usage_asked(body))

            return await self._stream(request, [prompt], sampling, "http_chat_completions", "chatcmpl", streamed, watch)
        results, version = await generate(self.servicer, request, [prompt], sampling, "http_chat_completions", watch)

        def answer():
            samples = finish(results, decode, stops)
            use = answers.usage(len(prompt), samples)
            return self.head("chatcmpl", version).obj(
                "chat.completion", choices=answers.chat_choices(samples, decode, body.logprobs), usage=use
            )

        out = await anyio.to_thread.run_sync(answer)
        response.headers["X-Weight-Version"] = str(version)
        return out


def _usage_asked(body) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def rollout_router(servicer, served: Served) -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["openai"])
    h = _Routes(servicer, served)
    r.get("/models", response_model=ModelList, summary="the served model, with the weight version it serves now")(
        h.models
    )
    r.get(
        "/models/{model_id:path}",
        response_model=ModelCard,
        summary="the served model by id",
        responses={404: _ERRORS[404]},
    )(h.model)
    r.post(
        "/completions",
        response_model=CompletionResponse,
        responses={**_STREAM, **_ERRORS},
        summary="OpenAI-compatible completions from the rollout's current weights",
    )(h.completions)
    r.post(
        "/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_STREAM, **_ERRORS},
        summary="OpenAI-compatible chat completions: the messages rendered with the model's chat template",
    )(h.chat)
    return r
