"""Concurrent requests on the built-in engine share decode steps (rollout_svc/engine/batcher.py) and
each gets what it would have got alone: the same tokens, log-probs within float rounding.

The reference is the same weights with batch_requests=False (each request decodes on its own
cache, the engine's former path). Real tiny transformers models on the CPU; nothing is timed
except the last test, which compares concurrent against sequential in one run.
"""

from __future__ import annotations

import threading
import time

import pytest

from rollout_svc.engine.base import SamplingParams
from rollout_svc.engine.builtin import BuiltinEngine
from rollout_svc.sync.transaction import SyncTransaction
from tests.unit.rollout_svc.engine.conftest import CONFIGS, qwen2_config

# a batched matmul may round differently from a one-row one; the ISSUE was wrong tokens, not 1e-7
LOGPROB_TOL = 1e-4


class Cancelled(Exception):
    pass


def _cancel_after(k: int):
    """A step() that stops the request at its k-th call, as the service's cancel check does."""
    calls = [0]

    def step():
        calls[0] += 1
        if calls[0] >= k:
            raise Cancelled(f"cancelled at step {k}")

    return step


def _end_sample_after(sample: int, k: int):
    """An emit that ends `sample` after its k-th token (a stop string completed), recording what it saw."""
    sent: dict[int, list[int]] = {}

    def emit(pi, toks):
        for t in toks:
            sent.setdefault(t.sample, []).append(t.token_id)
        return [sample] if len(sent.get(sample, [])) == k else None

    return emit, sent


def _specs(stop_token: int):
    """(prompts, sampling, kwargs factory) per request: mixed lengths, n > 1, sampling, stops, emit, cancel."""
    g = lambda m, **kw: SamplingParams(max_new_tokens=m, temperature=0.0, **kw)  # noqa: E731
    return [
        ([[5, 17, 42, 99, 3]], g(24), dict),
        ([[200, 1, 7]], g(9), dict),
        ([[9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]], g(30, n=3), dict),
        ([[33, 34]], SamplingParams(max_new_tokens=20, temperature=0.9, top_k=40, seed=11, n=4), dict),
        ([[5, 17, 42, 99, 3]], g(24, stop_token_ids=(stop_token,)), dict),
        ([[61, 62, 63, 64]], SamplingParams(max_new_tokens=18, temperature=1.0, seed=3, n=2), dict),
        ([[70, 71, 72], [4, 5]], g(12, n=2), lambda: {"emit": _end_sample_after(1, 5)[0]}),
        ([[80, 81, 82, 83, 84, 85]], g(40), lambda: {"step": _cancel_after(7)}),
    ]


def _run(engine, spec):
    prompts, sampling, kw = spec
    try:
        return engine.generate(prompts, sampling, **kw())
    except Cancelled as exc:
        return exc


def _assert_same(got, want):
    if isinstance(want, Exception):
        assert isinstance(got, Cancelled) and str(got) == str(want)
        return
    assert [(r.prompt_index, r.token_ids, r.finish_reason) for r in got] == [
        (r.prompt_index, r.token_ids, r.finish_reason) for r in want
    ]
    for a, b in zip(got, want):
        assert len(a.logprobs) == len(b.logprobs)
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) <= LOGPROB_TOL


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # tied embeddings change nothing here
def test_concurrent_requests_get_what_they_get_alone(kind):
    alone = BuiltinEngine.from_config(CONFIGS[kind](), seed=0, batch_requests=False)
    batched = BuiltinEngine.from_config(CONFIGS[kind](), seed=0)
    assert batched.batches_requests and not alone.batches_requests and alone.yields_between_steps
    probe = alone.generate([[5, 17, 42, 99, 3]], SamplingParams(max_new_tokens=24, temperature=0.0))[0]
    specs = _specs(stop_token=probe.token_ids[6])
    want = [_run(alone, s) for s in specs]
    assert want[4][0].finish_reason == "stop" and len(want[4][0].token_ids) <= 7  # the stop token is reached
    assert isinstance(want[7], Cancelled)

    got: list = [None] * len(specs)
    start = threading.Barrier(len(specs))

    def one(i):
        start.wait(30)
        got[i] = _run(batched, specs[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None, f"request {i} did not finish"
        _assert_same(g, w)
    b = batched._batcher
    assert b.widest >= 3, f"requests did not share decode steps (at most {b.widest} in one)"
    # every request left: the next one runs alone, on a fresh group, and gets the same again
    _assert_same(_run(batched, specs[2]), want[2])


def test_a_stalled_consumer_holds_neither_the_others_nor_a_load_after_it():
    """A request whose emit waits (a stream reader with no room) is away: the others decode without
    it; a sync (the gate's exclusive side) waits until it ended, and then nothing is in flight."""
    engine = BuiltinEngine.from_config(qwen2_config(), seed=0)
    tx = SyncTransaction(engine)
    release, entered = threading.Event(), threading.Event()

    def stalling(pi, toks):
        if not entered.is_set():
            entered.set()
            assert release.wait(30)

    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault("a", tx.serve(lambda e: e.generate([[1, 2, 3]], sp, emit=stalling), 10.0))
    )
    t.start()
    assert entered.wait(30)
    other = tx.serve(lambda e: e.generate([[4, 5, 6, 7]], sp), 10.0)[0]  # finishes while the first is stalled
    assert len(other[0].token_ids) == 8
    assert not tx.engine_lock.acquire(timeout=0.05), "a load must wait for the request in flight"
    release.set()
    t.join(30)
    assert len(out["a"][0][0].token_ids) == 8
    assert tx.engine_lock.acquire(timeout=5)
    tx.engine_lock.release()


@pytest.mark.serial
def test_concurrency_does_not_slow_it_down():
    """N requests at once take no longer than the same N one after another (on one model, one run)."""
    engine = BuiltinEngine.from_config(qwen2_config(), seed=0)
    sp = SamplingParams(max_new_tokens=32, temperature=0.0)
    prompts = [[1 + k, 2 + k, 3 + k, 4 + k] for k in range(6)]
    engine.generate(prompts[:1], sp)  # warm-up

    def sequential() -> float:
        t0 = time.perf_counter()
        for p in prompts:
            engine.generate([p], sp)
        return time.perf_counter() - t0

    def concurrent() -> float:
        threads = [threading.Thread(target=engine.generate, args=([p], sp)) for p in prompts]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return time.perf_counter() - t0

    # best of two each, interleaved, so a burst of load on a shared host hits both sides
    seq, conc = [], []
    for _ in range(2):
        seq.append(sequential())
        conc.append(concurrent())
    ratio = min(conc) / min(seq)
    assert ratio <= 1.1, f"{len(prompts)} concurrent requests took {ratio:.2f}x the time of the same in sequence"


def test_a_request_that_comes_later_runs_alone_first_then_joins():
    """Least steps first: a request that comes while another decodes runs its first steps without it
    (the older one waits, as with turns), merges once it has run as many steps (padded caches of two
    lengths), and both get what they get alone."""
    alone = BuiltinEngine.from_config(qwen2_config(), seed=0, batch_requests=False)
    engine = BuiltinEngine.from_config(qwen2_config(), seed=0)
    old_sp, new_sp = (SamplingParams(max_new_tokens=m, temperature=0.0) for m in (40, 30))
    old_p, new_p = [1, 2, 3, 4, 5, 6, 7, 8, 9], [50, 51, 52]
    want_old, want_new = alone.generate([old_p], old_sp), alone.generate([new_p], new_sp)
    counts = {"old": 0, "new": 0}
    old_at_new = []  # the old request's tokens when the new one had 1 and 8
    start_new = threading.Event()

    def counting(name):
        def emit(pi, toks):
            counts[name] += 1
            if name == "old" and counts["old"] == 10:
                start_new.set()
            if name == "new" and counts["new"] in (1, 8):
                old_at_new.append(counts["old"])

        return emit

    out = {}
    old = threading.Thread(target=lambda: out.setdefault("old", engine.generate([old_p], old_sp, emit=counting("old"))))
    old.start()
    assert start_new.wait(60)
    out["new"] = engine.generate([new_p], new_sp, emit=counting("new"))
    old.join(60)
    _assert_same(out["old"], want_old)
    _assert_same(out["new"], want_new)
    # the old one waited while the new one caught up (it may take a step or two the new one's thread missed)
    assert old_at_new[1] - old_at_new[0] < 7, old_at_new
    assert engine._batcher.widest == 2, "the new request never joined the old one"


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on():
    engine = BuiltinEngine.from_config(qwen2_config(), seed=0)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    want = engine.generate([[3, 4, 5]], sp)
    model = engine.model

    class Failing:
        def __call__(self, ids, **kw):
            if ids.shape[1] == 1:
                raise RuntimeError("CUDA out of memory (simulated)")
            return model(ids, **kw)

    engine.model = Failing()
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate([[3, 4, 5]], sp)
    engine.model = model
    _assert_same(engine.generate([[3, 4, 5]], sp), want)
