"""OpenAI-compatible `POST /v1/completions` on a rollout, for agent environments that speak that API.

It runs through the same generation path as gRPC Generate (`RolloutServicer.generate`): the same
budget and validation, the same fair admission, the same engine lock and metrics; a client that
disconnects stops its generation at the next decode step.
Differences from OpenAI's API, all explicit: the prompt may be token ids (the tiny built-in models
have no tokenizer, so text needs a model directory with one); `logprobs` returns the sampled token's
log-prob only (`top_logprobs` is null); no streaming; `weight_version` (and the `X-Weight-Version`
header) says which weights produced the answer.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

import anyio
from fastapi import APIRouter, Depends, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from rollout_svc.engine.base import SamplingParams
from weightsync.bus.errors import SyncError
from weightsync.http.auth import bearer_auth
from weightsync.http.types import Text

log = logging.getLogger(__name__)
_MAX_SEED = (1 << 63) - 1
_HTTP_STATUS = {"INVALID_ARGUMENT": 400, "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499, "DEADLINE_EXCEEDED": 504}
Prompt = Text | list[Text] | list[int] | list[list[int]]


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = Field(None, description="echoed back; a rollout serves one model")
    prompt: Prompt = Field(..., description="token ids, a list of token-id lists, text, or a list of texts "
                                            "(text needs a model with a tokenizer)")
    max_tokens: int = Field(16, description="new tokens per completion, 1..32768")
    temperature: float = Field(1.0, description="0 = greedy")
    top_p: float = 1.0
    top_k: int = Field(0, description="extension: 0 = off")
    n: int = Field(1, description="completions per prompt")
    logprobs: int | None = Field(None, description="0..5: return the sampled tokens' log-probs (top_logprobs is null)")
    seed: int | None = Field(None, description="sampling seed (default 0: a rollout's sampling is reproducible)")
    stop_token_ids: list[int] = Field(default_factory=list, description="extension: extra stop tokens")
    stream: Literal[False] = Field(False, description="streaming is not supported")
    echo: Literal[False] = False
    user: Text | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[dict]
    usage: dict
    weight_version: int = Field(..., description="the weight version every token of this answer came from")


class _Tokenizer:
    """The model directory's tokenizer, loaded on first use; None when the model has none."""

    def __init__(self, model: str):
        self.model, self._tok, self._loaded, self._lock = model, None, False, threading.Lock()

    def get(self):
        with self._lock:
            if not self._loaded:
                self._loaded = True
                if Path(self.model, "config.json").is_file():  # a model directory; tiny built-in names have none
                    try:
                        from transformers import AutoTokenizer

                        self._tok = AutoTokenizer.from_pretrained(self.model, local_files_only=True)
                    except Exception as exc:  # no (usable) tokenizer files there: token ids only, said once
                        log.info("model %s: no usable tokenizer (%s: %s); /v1/completions takes token ids only",
                                 self.model, type(exc).__name__, exc)
                        self._tok = None
            return self._tok


def _prompts(prompt: Prompt, tokenizer: _Tokenizer, model: str) -> list[list[int]]:
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        tok = tokenizer.get()
        if tok is None:
            raise HTTPException(400, f"prompt: text needs a tokenizer and model {model!r} has none; send token ids "
                                     "instead (\"prompt\": [1, 2, 3] or [[1, 2], [3, 4]]), or start the rollout "
                                     "with --model <HF directory that contains a tokenizer>")
        texts = [prompt] if isinstance(prompt, str) else prompt
        return [tok.encode(t, add_special_tokens=False) or [] for t in texts]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _check(body: CompletionRequest) -> None:
    if body.logprobs is not None and not 0 <= body.logprobs <= 5:
        raise HTTPException(400, f"logprobs={body.logprobs} must be in [0, 5]")
    if body.seed is not None and not 0 <= body.seed <= _MAX_SEED:
        raise HTTPException(400, f"seed={body.seed} must be in [0, 2**63 - 1]")
    for name in ("max_tokens", "n", "top_k"):
        v = getattr(body, name)
        if not -(1 << 31) <= v < (1 << 31):
            raise HTTPException(400, f"{name}={v} is out of range")


def _choices(results, tok, with_logprobs: bool) -> list[dict]:
    """OpenAI's choices, one per sample in prompt order; without a tokenizer, text is "" and the
    logprobs' tokens are the ids as strings."""
    out = []
    for i, res in enumerate(results):
        lp = None
        if with_logprobs:
            lp = {"tokens": [tok.decode([t]) if tok is not None else str(t) for t in res.token_ids],
                  "token_logprobs": res.logprobs, "top_logprobs": None, "text_offset": None}
        out.append({"index": i, "text": tok.decode(res.token_ids) if tok is not None else "",
                    "token_ids": res.token_ids, "logprobs": lp, "finish_reason": res.finish_reason})
    return out


def rollout_router(servicer, token: str, model: str) -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["inference"], dependencies=[Depends(bearer_auth(token))])
    tokenizer = _Tokenizer(model)

    @r.post("/completions", response_model=CompletionResponse,
            summary="OpenAI-compatible completions from the rollout's current weights",
            responses={400: {"description": "invalid request (the message names the field)"},
                       401: {"description": "missing or wrong token"},
                       503: {"description": "engine busy applying weights, STALE, or saturated; retry"}})
    async def completions(body: CompletionRequest, request: Request, response: Response):
        _check(body)
        prompts = await anyio.to_thread.run_sync(_prompts, body.prompt, tokenizer, model)
        try:
            sampling = SamplingParams(max_new_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                                      top_k=body.top_k, seed=body.seed or 0, stop_token_ids=tuple(body.stop_token_ids),
                                      n=body.n)
        except (TypeError, ValueError) as exc:
            raise HTTPException(400, str(exc)) from None
        # Fair admission counts requests per client, as gRPC does per peer.
        client = f"http:{request.client.host if request.client else 'unknown'}"
        gone = threading.Event()  # the client disconnected: the generation stops at its next step
        stopping = request.app.state.stopping  # the service is shutting down

        async def watch_disconnect():
            while not gone.is_set():
                if await request.is_disconnected():
                    gone.set()
                    return
                await anyio.sleep(0.1)

        def run():
            return servicer.generate(prompts, sampling, client,
                                     is_active=lambda: not (gone.is_set() or stopping.is_set()))

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            results, version = await anyio.to_thread.run_sync(run)
        except (ValueError, SyncError) as exc:
            code = getattr(exc, "code", "INVALID_ARGUMENT")
            # name the fields as this API does (the shared validation speaks of the gRPC fields)
            msg = str(exc).replace("sampling.max_new_tokens", "max_tokens").replace("sampling.", "")
            raise HTTPException(_HTTP_STATUS.get(code, 503), f"{code}: {msg}") from None
        finally:
            gone.set()  # a disconnect seen after this changes nothing
            watcher.cancel()
        tok = await anyio.to_thread.run_sync(tokenizer.get)  # loads once, off the event loop
        choices = _choices(results, tok, body.logprobs is not None)
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        response.headers["X-Weight-Version"] = str(version)
        return CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()),
                                  model=body.model or model, choices=choices, weight_version=version,
                                  usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                         "total_tokens": prompt_tokens + completion_tokens})

    return r
