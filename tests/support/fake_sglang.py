"""A stand-in for SGLang's in-process `Engine` (sglang.srt.entrypoints.engine) at the adapter's boundary,
generating and streaming as SGLang 0.5.10 and 0.5.23 do (read from their wheels):

- `generate(..., stream=True)` returns a plain generator that runs `self.loop` with run_until_complete
  for each item (Engine.generate's generator_wrapper); without `stream`, the list of final outputs.
- An item is one request's output so far, cumulative (incremental_streaming_output off): `output_ids`
  and `meta_info["output_token_logprobs"]` (rows `(logprob, token_id, None)`) hold every token so far,
  `meta_info["id"]` is the request's rid, `meta_info["finish_reason"]` is None until its last item.
- `tokenizer_manager.abort_request(rid)` must run on `self.loop` (it writes SGLang's ZMQ socket); the
  request then ends with an item whose finish_reason type is "abort" and makes no further token (that
  item's `output_ids` is not cumulative: 0.5.10 sends a queued request's abort with its last id only).

Requests decode round robin, one token per request per step (stream_interval=1). `per_item` > 1 makes
each item carry that many new tokens (SGLang coalescing a backlog). `hold_at` holds the engine before
step `hold_at` until `release()` or an abort: what a client got by then was sent before generation went on;
with `hold_prompt`, only the calls whose first prompt is `hold_prompt` are held (the others run on: the
adapter runs the loop on its own thread, sglang_loop.py, so several calls are in the fake at once, as in
SGLang's scheduler).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import torch

#: answer(request index, prompt ids, sampling params) -> (token ids, log-probs, finish type) of a whole request
Answer = Callable[[int, list[int], dict], tuple[list[int], list[float], str]]


def scripted(ids: list[int], lps: list[float], finish: str = "length") -> Answer:
    """Every request answers `ids` with `lps` (cut to its max_new_tokens)."""

    def answer(k: int, prompt: list[int], params: dict) -> tuple[list[int], list[float], str]:
        m = params.get("max_new_tokens", len(ids))
        return list(ids[:m]), list(lps[:m]), finish if m >= len(ids) else "length"

    return answer


class _TokenizerManager:
    def __init__(self, sgl: FakeSglang):
        self.sgl = sgl

    async def pause_generation(self, obj) -> None:
        self.sgl.events.append("pause")

    async def continue_generation(self, obj) -> None:
        self.sgl.events.append("continue")

    def abort_request(self, rid: str) -> None:
        running = asyncio.get_running_loop()  # raises outside a running loop: SGLang's socket is the loop's
        assert running is getattr(self.sgl.loop, "loop", self.sgl.loop), "abort_request must run on Engine.loop"
        self.sgl.aborted.append(rid)
        for wake in self.sgl._wakes:
            wake.set()


class FakeSglang:
    def __init__(
        self,
        answer: Answer,
        hold_at: int | None = None,
        per_item: int = 1,
        hold_s: float = 30.0,
        hold_prompt: list[int] | None = None,
    ):
        self.answer, self.hold_at, self.per_item, self.hold_s = answer, hold_at, per_item, hold_s
        self.hold_prompt = hold_prompt
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = _TokenizerManager(self)
        self.calls: list[dict] = []  # the keywords of every generate call
        self.aborted: list[str] = []
        self.made: dict[str, int] = {}  # rid -> tokens decoded
        self.finished: set[str] = set()  # rids whose last item was made
        self.held = threading.Event()
        self._released = False
        self._wakes: set[asyncio.Event] = set()  # one per call in progress
        self._loop = self.loop  # the real loop, whatever stands in for Engine.loop
        self.weights: dict[str, torch.Tensor] = {}  # what the TP worker holds, by checkpoint name
        self.offload_tags: set[str] = set()  # memory tags released (the scheduler's own set)
        self.events: list[str] = []  # weight and memory calls, in order
        self.fail_release = ""  # set: release_memory_occupation raises with this message

    # ---- weights and memory, as the scheduler of 0.5.10 keeps them (scheduler_update_weights_mixin.py) ----
    def _event(self, what: str) -> None:
        self.events.append(what)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        async def run():
            if "weights" in self.offload_tags:  # the real one writes into unmapped memory: a CUDA fault
                raise AssertionError("update_weights_from_tensor while SGLang's weights are released")
            for name, t in named_tensors:
                self.weights[name] = t.clone()
            self._event("update")
            return True, "Succeeded to update model weights."

        return self.loop.run_until_complete(run())

    def release_memory_occupation(self, tags=None):
        async def run():
            assert not self._wakes, "release_memory_occupation should be called only when server is idle."
            if self.fail_release:
                raise RuntimeError(self.fail_release)
            for t in tags or ("kv_cache", "weights", "cuda_graph"):
                self.offload_tags.add(t)
                if t == "weights":
                    self.weights = {n: torch.full_like(w, float("nan")) for n, w in self.weights.items()}
            self._event("release:" + ",".join(tags or ("all",)))

        return self.loop.run_until_complete(run())

    def resume_memory_occupation(self, tags=None):
        async def run():
            for t in tags or ("kv_cache", "weights", "cuda_graph"):
                self.offload_tags.remove(t)  # KeyError on a tag not released, as SGLang's scheduler
            self._event("resume:" + ",".join(tags or ("all",)))

        return self.loop.run_until_complete(run())

    def flush_cache(self):
        async def run():
            self._event("flush")
            return True

        return self.loop.run_until_complete(run())

    def release(self) -> None:
        """From the test's thread: a held engine goes on."""
        self._released = True

        def wake_all():
            for wake in self._wakes:
                wake.set()

        self._loop.call_soon_threadsafe(wake_all)

    def generate(self, input_ids, sampling_params, return_logprob=False, rid=None, stream=False, **kw):
        if self.offload_tags:
            raise AssertionError(f"generate while SGLang's {sorted(self.offload_tags)} are released")
        self.calls.append(
            dict(input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob, rid=rid)
            | dict(stream=stream, **kw)
        )
        assert isinstance(input_ids[0], list) and len(rid) == len(input_ids), "the adapter sends one batch"
        hold = self.hold_prompt is None or list(input_ids[0]) == list(self.hold_prompt)
        answers = [self.answer(k, p, sampling_params[k]) for k, p in enumerate(input_ids)]
        items = self._items(list(rid), answers, hold)
        if stream:

            def generator_wrapper():  # as Engine.generate(stream=True)
                while True:
                    try:
                        yield self.loop.run_until_complete(items.__anext__())
                    except StopAsyncIteration:
                        break

            return generator_wrapper()

        async def whole():
            last = {}
            async for out in items:
                last[out["meta_info"]["id"]] = out
            return [last[r] for r in rid]

        return self.loop.run_until_complete(whole())

    async def _items(self, rids: list[str], answers, hold: bool = True):
        wake = asyncio.Event()
        self._wakes.add(wake)
        try:
            async for item in self._steps(rids, answers, hold, wake):
                yield item
        finally:
            self._wakes.discard(wake)

    async def _steps(self, rids: list[str], answers, hold: bool, wake: asyncio.Event):
        ids = {r: [] for r in rids}
        open_ = list(rids)
        step = 0
        while open_:
            if hold and step == self.hold_at and not self._released:
                self.held.set()
                await asyncio.wait_for(self._wait_release_or_abort(rids, wake), self.hold_s)
            for k, r in enumerate(rids):
                if r not in open_:
                    continue
                want, lps, kind = answers[k]
                if r in self.aborted:
                    open_.remove(r)
                    self.finished.add(r)
                    # as 0.5.10's _handle_abort_req sends a streamed abort: its last token only, not cumulative
                    yield self._item(r, ids[r][-1:], lps, {"type": "abort", "message": "Abort in waiting queue"})
                    continue
                took = want[len(ids[r]) : len(ids[r]) + self.per_item]
                ids[r] += took
                self.made[r] = len(ids[r])
                done = len(ids[r]) == len(want)
                if done:
                    open_.remove(r)
                    self.finished.add(r)
                yield self._item(r, ids[r], lps, {"type": kind} if done else None)
            step += 1

    async def _wait_release_or_abort(self, rids: list[str], wake: asyncio.Event) -> None:
        while not self._released and not set(rids) & set(self.aborted):
            wake.clear()
            await wake.wait()

    @staticmethod
    def _item(rid: str, ids: list[int], lps: list[float], finish) -> dict:
        rows = [(lps[j], t, None) for j, t in enumerate(ids)]
        meta = {"id": rid, "finish_reason": finish, "output_token_logprobs": rows, "cached_tokens": 0}
        return {"output_ids": list(ids), "meta_info": meta}


def adapter_on(fake: FakeSglang, **opts):
    """rollout-svc's SglangEngine driving `fake` (its SGLang Engine is never started)."""
    from rollout_svc.engine.sglang_engine import SglangEngine, SglangOptions, drive_loop

    eng = SglangEngine.__new__(SglangEngine)
    eng.opts = SglangOptions(model_path="/fake-sglang-model", **opts)
    eng.tp_size, eng._metas, eng._update_group, eng._hf_config = 1, {}, "", None
    eng._sgl = fake
    drive_loop(fake)  # as SglangEngine.__init__: the loop runs on its own thread, fake.loop becomes a LoopThread
    return eng
