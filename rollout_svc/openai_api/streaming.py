"""Token streaming: the engine's thread hands each decode step's tokens to the event loop as it runs.

The generation runs in its own thread through `RolloutServicer.generate` (budget, admission,
engine gate, metrics) with `on_start` and `emit`; its events go through a bounded channel to the
response. The producer never waits long on a slow reader: while the channel is full it waits at
most STALL_S for room, then the generation is cancelled, as when the client disconnects (either
stops it at its next step and frees the engine). It waits with the engine lent (engine_gate.Lend):
other requests take turns meanwhile, so a stalled reader holds up only its own request. Every wait
of the reader has a timeout too. With stop strings, the emit hook also tells the engine which
choices a stop string ended (stop_watch.StopWatch), so it decodes no further than the answer needs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

import anyio
from fastapi import Request

from rollout_svc.engine.base import SamplingParams, TokenOut
from rollout_svc.openai_api.generation import api_error, client_of, watch_disconnect
from rollout_svc.openai_api.stop_watch import StopWatch
from rollout_svc.sync.engine_gate import no_lend
from weightsync.bus.errors import SyncError
from weightsync.http.errors import ApiError
from weightsync.obs import tracing

log = logging.getLogger(__name__)

QUEUE_EVENTS = 1024  # events buffered for a reader that lags (one event = one decode step of one prompt)
# A reader that makes no room for this long is gone: the generation stops (its pin, its admission
# slot and its KV cache are held meanwhile, though other requests take turns on the engine).
STALL_S = 5.0
EVENT_WAIT_S = 600.0  # the longest wait for the next event (a request queued for the engine, then a step)


@dataclass
class Started:
    """The engine admitted the request; every token will come from `version`."""

    version: int


@dataclass
class Tokens:
    """The tokens one decode step added to one prompt's samples."""

    prompt_index: int
    tokens: list[TokenOut]


@dataclass
class Done:
    """The generation's results (every token, also those an engine that cannot stream never emitted)."""

    results: list
    version: int


@dataclass
class Failed:
    error: ApiError


def _cancelled(why: str) -> SyncError:
    return SyncError(f"{why}; generation stopped", "CANCELLED")


class Channel:
    """Events from the engine's thread to the event loop, at most `capacity` waiting."""

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int = QUEUE_EVENTS, stall_s: float = STALL_S):
        self._loop, self._q, self.stall_s = loop, asyncio.Queue(), stall_s
        self._room = threading.Semaphore(capacity)
        self.closed = threading.Event()  # the reader is gone: the generation stops at its next step
        # how the producer waits for room: its request's engine_gate.Lend once the engine started it
        # (other requests take turns meanwhile), a plain wait until then
        self.lend = no_lend

    def put(self, event) -> None:
        """From the engine's thread: raises (a CANCELLED SyncError, which stops the generation) once the
        reader is gone or has made no room for `stall_s`."""
        if not self._room.acquire(blocking=False):
            room = []

            def ready(wait_s: float) -> bool:
                if self.closed.is_set():
                    return True
                if self._room.acquire(timeout=wait_s):
                    room.append(True)
                    return True
                return False

            self.lend(ready, self.stall_s)
            if not room and not self.closed.is_set():
                self.closed.set()
                raise _cancelled(f"the client read none of the last {self._q.qsize()} events for {self.stall_s:g} s")
        if self.closed.is_set():
            raise _cancelled("the client of the stream went away")
        self._send((True, event))

    def finish(self, event) -> None:
        """The last event (Done, Failed): takes no room and never waits."""
        self._send((False, event))

    def _send(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._q.put_nowait, item)
        except RuntimeError:  # the loop is closed (the service stopped): nobody reads any more
            self.closed.set()

    async def get(self, timeout: float) -> list:
        """Every event waiting, at least one (TimeoutError after `timeout` s without any)."""
        with anyio.fail_after(timeout):
            items = [await self._q.get()]
        while not self._q.empty():
            items.append(self._q.get_nowait())
        for took_room, _ in items:
            if took_room:
                self._room.release()
        return [event for _, event in items]


class StreamRun:
    """One streamed generation: started in a worker thread on construction (inside the event loop)."""

    def __init__(
        self,
        servicer,
        request: Request,
        prompts: list[list[int]],
        sampling: SamplingParams,
        endpoint: str,
        watch: StopWatch | None = None,
    ):
        """`watch`: the request's stop strings, watched as the tokens come (none: no watching)."""
        self.channel = channel = Channel(asyncio.get_running_loop(), QUEUE_EVENTS, STALL_S)
        stopping = request.app.state.stopping  # the service is shutting down
        client = client_of(request)

        def started(version: int, lend) -> None:
            channel.lend = lend
            channel.put(Started(version))

        def emit(prompt_index: int, tokens: list[TokenOut]) -> list[int] | None:
            channel.put(Tokens(prompt_index, tokens))
            return watch(prompt_index, tokens) if watch is not None else None

        def work():
            try:
                with (
                    tracing.generation_span(endpoint, request.headers),
                    servicer.rollout_metrics.generation(endpoint) as done,
                ):
                    results, version = servicer.generate(
                        prompts,
                        sampling,
                        client,
                        is_active=lambda: not (channel.closed.is_set() or stopping.is_set()),
                        emit=emit,
                        on_start=started,
                    )
                    done(sum(map(len, prompts)), sum(len(r.token_ids) for r in results))
                channel.finish(Done(results, version))
            except (ValueError, SyncError) as exc:
                channel.finish(Failed(api_error(exc)))
            except Exception as exc:  # a bug or an engine failure: the client must still get an answer
                log.exception("streamed generation failed")
                channel.finish(Failed(ApiError(500, f"generation failed: {type(exc).__name__}: {exc}")))

        # Its own thread, not one of anyio's pool: a stream holds it for the whole generation, and the
        # pool's threads must stay free for rendering the chunks (streams = admitted requests, bounded).
        threading.Thread(target=work, name="openai-stream", daemon=True).start()
        self._watcher = asyncio.ensure_future(watch_disconnect(request, channel.closed))

    async def events(self) -> list:
        """The next events, at least one; a Failed once none came for EVENT_WAIT_S (the generation is stopped)."""
        try:
            return await self.channel.get(EVENT_WAIT_S)
        except TimeoutError:
            self.close()
            return [Failed(ApiError(504, f"no token came for {EVENT_WAIT_S:g} s; generation stopped", code="timeout"))]

    async def opening(self) -> tuple[int, list]:
        """(weight version, the events so far) once the stream can start: the first tokens or the whole
        answer exist. A failure before that is raised as the ApiError it is (an ordinary HTTP error)."""
        version, seen, answered = None, [], False
        while not answered:
            for e in await self.events():
                if not answered:
                    if isinstance(e, Failed):
                        self.close()
                        raise e.error
                    if isinstance(e, Started):
                        version = e.version
                    elif isinstance(e, (Tokens, Done)):
                        answered = True
                        version = e.version if version is None and isinstance(e, Done) else version
                seen.append(e)
        return version, seen

    def close(self) -> None:
        """The reader is done (or gone): a generation still running stops at its next step."""
        self.channel.closed.set()
        self._watcher.cancel()
