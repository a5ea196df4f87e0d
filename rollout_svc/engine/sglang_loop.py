"""SGLang's asyncio loop, run forever on a thread of its own, so that many threads can call SGLang at once.

SGLang's in-process `Engine` (0.5.10 and 0.5.23, srt/entrypoints/engine.py) keeps one asyncio loop,
`Engine.loop` (made in `__init__`: the running loop, else a new one set as the current loop), and every
sync method is `self.loop.run_until_complete(<a tokenizer-manager coroutine>)`: `generate` runs
`tokenizer_manager.generate_request(obj)`'s first item, `generate(stream=True)` returns a generator that
runs each next item, `flush_cache`, `update_weights_*`, `init/destroy_weights_update_group`,
`release/resume_memory_occupation`, `begin/end_weight_update` (0.5.23) wrap the tokenizer manager's
coroutine of the same name. Two threads calling them at once collide: `run_until_complete` on a loop
another thread is running raises "This event loop is already running", so the adapter used to serialise
every call, and SGLang's continuous batching never saw two rollout requests at once.

`LoopThread` runs that loop with `run_forever` on one thread for the Engine's whole life and stands in for
`Engine.loop` (the adapter assigns it: `engine.loop = LoopThread(engine.loop)`). Its
`run_until_complete(aw)` hands `aw` to the loop thread (`asyncio.run_coroutine_threadsafe`) and waits for
its result on the calling thread. So each SGLang sync method runs exactly the coroutine it always ran, on
SGLang's own loop, built by SGLang's own code for the installed version (the adapter rebuilds no request
object), while any number of threads wait at once: their requests are in SGLang's scheduler together.
This is correct on both wheels because, in both, `Engine` touches `self.loop` only to assign it in
`__init__` and to call `self.loop.run_until_complete(...)` (checked against the wheels by
tests/unit/rollout_svc/engine/sglang: `ENGINE_LOOP_USES` in sglang_api.py), and the tokenizer manager
never reads `Engine.loop`: it creates its `handle_loop` task on the running loop
(`auto_create_handle_loop` -> `get_or_create_event_loop`, called from `generate_request`, so on this
thread; it installs signal handlers only on the main thread, which this is not). The loop also runs
between calls now, so `handle_loop` reads SGLang's replies as they come rather than only while some
call is waiting.

Aborts (`call_soon_threadsafe`) go straight to the loop: they run on its thread, as SGLang's ZMQ socket needs.
A call from the loop thread itself would wait for itself: it is refused.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from typing import Any

#: Longest one SGLang call may take before the waiting thread gives up (a generate of many long
#: requests, a weight update of a large model): far above any real call, but no wait is unbounded.
CALL_TIMEOUT_S = 6 * 3600.0


async def _awaited(aw: Awaitable) -> Any:
    # run_coroutine_threadsafe takes coroutines only; an async generator's __anext__() is an awaitable
    return await aw


class LoopThread:
    """Drop-in for SGLang's `Engine.loop`: the loop runs forever on its own thread; `run_until_complete`
    may be called from any number of other threads at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float = CALL_TIMEOUT_S):
        if loop.is_running():
            raise RuntimeError(
                "SGLang's Engine.loop is already running (the Engine was built inside a running asyncio loop, which it "
                "then adopts); build SglangEngine outside any asyncio loop, so the adapter can run it on its own thread"
            )
        self.loop, self.timeout_s = loop, timeout_s
        self._thread = threading.Thread(target=self._run, name="sglang-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run_until_complete(self, aw: Awaitable) -> Any:
        refused = None
        if threading.current_thread() is self._thread:
            refused = "an SGLang call from SGLang's own loop thread would wait for itself; await it instead"
        elif not self._thread.is_alive():
            refused = "SGLang's loop thread has stopped (the engine was closed); no call can run"
        if refused is not None:
            if asyncio.iscoroutine(aw):
                aw.close()  # never run: no "never awaited" warning
            raise RuntimeError(refused)
        fut = asyncio.run_coroutine_threadsafe(_awaited(aw), self.loop)
        try:
            return fut.result(self.timeout_s)
        except TimeoutError:
            if fut.done():
                raise  # the call's own TimeoutError, not this wait's
            fut.cancel()
            raise TimeoutError(
                f"an SGLang call took over {self.timeout_s:.0f} s (sglang_loop.CALL_TIMEOUT_S); it was cancelled"
            ) from None

    def call_soon_threadsafe(self, callback, *args):
        return self.loop.call_soon_threadsafe(callback, *args)

    def is_running(self) -> bool:
        return self.loop.is_running()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (what is still pending on it stays pending) and wait for its thread."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
