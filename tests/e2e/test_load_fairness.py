"""Bounded loopback load test: small Generate requests stay fast while a large one runs.

A real rollout-svc process; the measurement is bench/bench_fairness.py (also runnable against any
rollout, e.g. on a GPU host). Small requests (1 prompt, 8 new tokens) are timed on the idle engine,
then again while a maximal allowed request runs (the default per-request budget to its limit:
n = max_n, prompts x n x max_new_tokens = max_request_tokens; minutes of decoding on this model);
the large one is then cancelled. The built-in engine runs the group of requests with the fewest
decode steps first (rollout_svc/engine/batcher.py; a model that cannot be batched takes turns in the
engine gate, the same rule), so a small request runs its few steps while the large one waits.
Before the gate, the small requests queued behind the whole large request and timed out.

The built-in engine decodes one prompt's n samples as a batch, so a step's cost grows with n; the
number of prompts and new tokens only make the request longer.
"""

from __future__ import annotations

import json

import pytest

from bench.bench_fairness import measure
from rollout_svc.limits import LimitsConfig

_L = LimitsConfig()
# 16-token prompts + 256 new tokens fit the tiny model's 512 positions
BIG = dict(big_prompts=_L.max_request_tokens // (_L.max_n * 256), big_n=_L.max_n, big_tokens=256)


@pytest.mark.serial
def test_small_request_p99_within_2x_of_idle_while_a_large_request_runs(procs):
    assert BIG["big_prompts"] * BIG["big_n"] * BIG["big_tokens"] == _L.max_request_tokens  # the largest allowed
    r = procs.rollout("--model", "tiny-qwen2", "--serve-initial-weights")  # no trainer here
    r.wait_ready()
    # 500 samples: the p99 of 60 is their largest and of 200 their third largest, so a scheduling
    # hiccup or two on a shared 2-core box decided it (CI failed at 2.0006x and 2.11x); of 500, the sixth.
    # In 5 alternating idle/loaded rounds, so a busy spell of the box (CI failed at 2.08x with 500 in
    # one round) lands on both sides.
    res = measure(r.address, samples=500, rounds=5, **BIG)
    print("\n" + json.dumps(res, indent=2))
    assert res["big"]["running_through_measurement"], "the large request ended early: the load was not applied"
    assert res["big"]["outcome"] == "cancelled"
    assert res["loaded_p99_s"] <= 2 * res["idle_p99_s"], res
    assert res["engine_free_after_cancel_s"] < 1.0, res
