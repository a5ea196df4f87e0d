"""Run one OpenAI request through the rollout's generation path (`RolloutServicer.generate`).

The same budget and validation as gRPC Generate, the same fair admission, engine gate and metrics;
a client that disconnects stops its generation at the next decode step. Errors come back as
OpenAI error bodies with the HTTP status of their gRPC code.
"""

from __future__ import annotations

import asyncio
import threading

import anyio
from fastapi import Request

from rollout_svc.engine.base import SamplingParams
from weightsync.bus.errors import SyncError
from weightsync.http.errors import ApiError
from weightsync.obs import tracing

_MAX_SEED = (1 << 63) - 1
# gRPC code -> HTTP status; anything else the servicer raises (UNAVAILABLE: busy applying weights,
# STALE, saturated) is a 503 the client may retry.
_HTTP_STATUS = {"INVALID_ARGUMENT": 400, "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499, "DEADLINE_EXCEEDED": 504}


def check_ranges(**values: int | None) -> None:
    """Integers that must fit the engine's types, checked before anything is built from them."""
    for name, v in values.items():
        if v is not None and not -(1 << 31) <= v < (1 << 31):
            raise ApiError(400, f"{name}={v} is out of range", name)


def sampling_params(body, max_tokens: int) -> SamplingParams:
    if body.seed is not None and not 0 <= body.seed <= _MAX_SEED:
        raise ApiError(400, f"seed={body.seed} must be in [0, 2**63 - 1]", "seed")
    check_ranges(max_tokens=max_tokens, n=body.n, top_k=body.top_k)
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed or 0,
            stop_token_ids=tuple(body.stop_token_ids),
            n=body.n,
        )
    except (TypeError, ValueError) as exc:
        raise ApiError(400, str(exc)) from None


def client_of(request: Request) -> str:
    """The client a request is admitted as: fair admission counts requests per client, as gRPC does per peer."""
    return f"http:{request.client.host if request.client else 'unknown'}"


def api_error(exc: ValueError | SyncError) -> ApiError:
    """A refusal or failure of the generation path, as OpenAI's error with the HTTP status of its gRPC code."""
    code = getattr(exc, "code", "INVALID_ARGUMENT")
    # name the fields as this API does (the shared validation speaks of the gRPC fields)
    msg = str(exc).replace("sampling.max_new_tokens", "max_tokens").replace("sampling.", "")
    return ApiError(_HTTP_STATUS.get(code, 503), f"{code}: {msg}", code=code.lower())


async def watch_disconnect(request: Request, gone: threading.Event) -> None:
    """Set `gone` once the client disconnects (the generation stops at its next step)."""
    while not gone.is_set():
        if await request.is_disconnected():
            gone.set()
            return
        await anyio.sleep(0.1)


async def generate(
    servicer, request: Request, prompts: list[list[int]], sampling: SamplingParams, endpoint: str, watch=None
):
    """(results, weight version) of one request; the engine runs in a worker thread. `endpoint`
    labels its latency and token metrics (weightsync.obs.metrics.ENDPOINTS). `watch` (a
    stop_watch.StopWatch, for a request with stop strings) is the engine's emit hook: a choice whose
    text completed a stop string is decoded no further."""
    client = client_of(request)
    gone = threading.Event()  # the client disconnected: the generation stops at its next step
    stopping = request.app.state.stopping  # the service is shutting down

    def run():
        with tracing.generation_span(endpoint, request.headers), servicer.rollout_metrics.generation(endpoint) as done:
            results, version = servicer.generate(
                prompts, sampling, client, is_active=lambda: not (gone.is_set() or stopping.is_set()), emit=watch
            )
            done(sum(map(len, prompts)), sum(len(r.token_ids) for r in results))
            return results, version

    watcher = asyncio.ensure_future(watch_disconnect(request, gone))
    try:
        return await anyio.to_thread.run_sync(run)
    except (ValueError, SyncError) as exc:
        raise api_error(exc) from None
    finally:
        gone.set()  # a disconnect seen after this changes nothing
        watcher.cancel()
