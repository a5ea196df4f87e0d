"""Several threads call the SGLang adapter at once and their requests run together (sglang_loop.py), on CPU.

tests/support/fake_sglang.py stands in for SGLang's Engine: its sync methods run `self.loop.run_until_complete`,
as SGLang 0.5.10 / 0.5.23 do, which two threads could not do at once on a loop neither runs. Nothing is
timed: the fake holds a call at a step until the test releases it (or the call is aborted).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout_svc.engine.base import SamplingParams
from rollout_svc.engine.sglang_loop import LoopThread
from tests.support.fake_sglang import FakeSglang, adapter_on, scripted

IDS = [11, 12, 13, 14, 15, 16]
LPS = [-0.5 - j / 8 for j in range(len(IDS))]
WAIT_S = 10.0
SAMPLING = SamplingParams(max_new_tokens=6, n=2, seed=3)


def _rows(res):
    return [(x.prompt_index, x.token_ids, x.logprobs, x.finish_reason, x.prefix_cache_hit) for x in res]


class _Call:
    """eng.generate on a thread of its own."""

    def __init__(self, fn):
        self.result, self.error, self.done = None, None, threading.Event()

        def run():
            try:
                self.result = fn()
            except BaseException as exc:  # noqa: BLE001 — the test reads it
                self.error = exc
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True).start()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_second_call_completes_while_the_first_is_held(stream):
    solo = adapter_on(FakeSglang(scripted(IDS, LPS)), deterministic=True)
    want_a, want_b = solo.generate([[1, 2]], SAMPLING), solo.generate([[3]], SAMPLING)
    fake = FakeSglang(scripted(IDS, LPS), hold_at=1, hold_s=WAIT_S, hold_prompt=[1, 2])
    eng = adapter_on(fake, deterministic=True)
    kw = {"emit": lambda i, toks: None} if stream else {}
    a = _Call(lambda: eng.generate([[1, 2]], SAMPLING, **kw))
    assert fake.held.wait(WAIT_S)
    b = _Call(lambda: eng.generate([[3]], SAMPLING, **kw))
    assert b.done.wait(WAIT_S) and b.error is None, b.error
    a_rids = set(fake.calls[0]["rid"])
    assert not a.done.is_set() and not a_rids & fake.finished  # A is still held in SGLang
    fake.release()
    assert a.done.wait(WAIT_S) and a.error is None, a.error
    # results as on an idle engine: the same seeds per sample, log-probs, finish reasons, cache hits
    assert _rows(a.result) == _rows(want_a) and _rows(b.result) == _rows(want_b)
    assert [p["sampling_seed"] for c in fake.calls for p in c["sampling_params"]] == [3, 4, 3, 4]
    assert not fake.aborted


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_cancelling_one_call_aborts_only_its_requests(stream):
    fake = FakeSglang(scripted(IDS, LPS), hold_at=2, hold_s=WAIT_S)  # every call is held
    eng = adapter_on(fake)
    kw = {"emit": lambda i, toks: None} if stream else {}
    gone = threading.Event()

    def step():
        if gone.is_set():
            raise ConnectionAbortedError("the client went away")

    keep = _Call(lambda: eng.generate([[3]], SAMPLING, step=lambda: None, **kw))
    assert fake.held.wait(WAIT_S)
    cancelled = _Call(lambda: eng.generate([[1, 2]], SAMPLING, step=step, **kw))
    while len(fake.calls) < 2:
        assert not cancelled.done.wait(0.005)
    gone.set()
    assert cancelled.done.wait(WAIT_S) and isinstance(cancelled.error, ConnectionAbortedError)
    keep_rids, gone_rids = set(fake.calls[0]["rid"]), set(fake.calls[1]["rid"])
    assert set(fake.aborted) == gone_rids and gone_rids <= fake.finished
    assert not keep.done.is_set() and not keep_rids & fake.finished  # still held, not aborted
    fake.release()
    assert keep.done.wait(WAIT_S) and keep.error is None
    assert [r.token_ids for r in keep.result] == [IDS, IDS] and not keep_rids & set(fake.aborted)


def test_loop_thread_runs_many_waiting_calls_at_once():
    """N threads each wait on SGLang's loop for an event that is set only once all N are waiting there: with
    one call at a time (run_until_complete from the caller's thread) the first would never return."""
    loop = asyncio.new_event_loop()
    lt = LoopThread(loop, timeout_s=WAIT_S)
    n, waiting = 4, []
    everyone = asyncio.Event()

    async def call(k):
        waiting.append(k)
        if len(waiting) == n:
            everyone.set()
        await everyone.wait()
        return k

    calls = [_Call(lambda k=k: lt.run_until_complete(call(k))) for k in range(n)]
    assert all(c.done.wait(WAIT_S) for c in calls)
    assert [c.result for c in calls] == list(range(n))

    async def reenter():
        return lt.run_until_complete(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="own loop thread"):
        lt.run_until_complete(reenter())
    lt.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        lt.run_until_complete(asyncio.sleep(0))
    loop.close()


def test_loop_thread_gives_up_a_call_that_never_ends():
    loop = asyncio.new_event_loop()
    lt = LoopThread(loop, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="CALL_TIMEOUT_S"):
        lt.run_until_complete(asyncio.Event().wait())
    lt.stop()
    loop.close()


def test_loop_thread_refuses_a_loop_someone_else_runs():
    async def build():
        with pytest.raises(RuntimeError, match="outside any asyncio loop"):
            LoopThread(asyncio.get_running_loop())

    asyncio.run(build())
