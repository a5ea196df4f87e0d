"""Latency of small Generate requests on an idle rollout vs. while one large request runs.

The rollout's engine gate lets requests take turns between decode steps (shortest attained
service first), so a small request should wait about one step of the large one, not all of it.
This measures it against any rollout-svc (gRPC), e.g. on a GPU host:

    python -m bench fairness --address 127.0.0.1:50061 --big-prompts 8 --big-n 64 --big-tokens 480

It prints one JSON object: p50/p99 of the small requests idle (before and after each loaded round,
pooled) and loaded, their ratio, and how long the engine took to free up after the large request
was cancelled.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import grpc

from weightsync.control.auth import call_metadata
from weightsync.control.client import channel, rollout_stub
from weightsync.v1 import rollout_pb2, rollout_pb2_grpc


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def _request(prompts: int, n: int, tokens: int, prompt_len: int, seed: int) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompts=[
            rollout_pb2.Prompt(token_ids=[(seed + i * 7 + j) % 200 + 1 for j in range(prompt_len)])
            for i in range(prompts)
        ],
        sampling=rollout_pb2.SamplingParams(max_new_tokens=tokens, n=n, temperature=1.0, seed=seed),
    )


def _timed(stub, req, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        stub.Generate(req, timeout=60)
        out.append(time.perf_counter() - t0)
    return out


def measure(
    address: str,
    token: str = "",
    samples: int = 100,
    small_tokens: int = 8,
    big_prompts: int = 8,
    big_n: int = 64,
    big_tokens: int = 480,
    big_timeout: float = 600.0,
    rounds: int = 1,
) -> dict:
    """`rounds` alternations of an idle phase and a loaded one (samples/rounds small requests each,
    the large request started and cancelled in each loaded phase), then one more idle phase: a
    machine that gets busier or quieter meanwhile tilts both sides alike."""
    per = max(1, samples // rounds)
    idle: list[float] = []
    loaded: list[float] = []
    still_running, outcomes, freed = True, set(), []
    with channel(address) as ch:
        stub = rollout_stub(ch, token, 60)
        small = _request(1, 1, small_tokens, 8, seed=1)
        _timed(stub, small, 5)  # warm-up
        for _ in range(rounds):
            idle += _timed(stub, small, per)
            # gRPC's own future: cancelling it cancels the call on the server too
            big = rollout_pb2_grpc.RolloutStub(ch).Generate.future(
                _request(big_prompts, big_n, big_tokens, 16, seed=2), timeout=big_timeout, metadata=call_metadata(token)
            )
            time.sleep(0.5)  # the large request is prefilled and decoding
            loaded += _timed(stub, small, per)
            still_running &= not big.done()
            t0 = time.perf_counter()
            big.cancel()
            # the engine is free again once a small request gets through without queueing behind it
            _timed(stub, small, 1)
            freed.append(time.perf_counter() - t0)
            try:
                big.result()
                outcomes.add("finished")
            except grpc.FutureCancelledError:
                outcomes.add("cancelled")
            except grpc.RpcError as exc:
                outcomes.add(exc.code().name)
        idle += _timed(stub, small, max(1, per // 2))
    r = {
        "samples": samples,
        "rounds": rounds,
        "small_tokens": small_tokens,
        "big": {
            "prompts": big_prompts,
            "n": big_n,
            "max_new_tokens": big_tokens,
            "outcome": "/".join(sorted(outcomes)),
            "running_through_measurement": still_running,
        },
        "idle_p50_s": _pct(idle, 0.5),
        "idle_p99_s": _pct(idle, 0.99),
        "loaded_p50_s": _pct(loaded, 0.5),
        "loaded_p99_s": _pct(loaded, 0.99),
        "engine_free_after_cancel_s": max(freed),
    }
    r["p99_ratio"] = r["loaded_p99_s"] / r["idle_p99_s"]
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="rollout gRPC address")
    p.add_argument("--token", default="")
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--small-tokens", type=int, default=8)
    p.add_argument("--big-prompts", type=int, default=8)
    p.add_argument("--big-n", type=int, default=64)
    p.add_argument("--big-tokens", type=int, default=480)
    p.add_argument("--rounds", type=int, default=1, help="alternations of idle and loaded phases")
    p.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    a = p.parse_args(argv)
    r = measure(a.address, a.token, a.samples, a.small_tokens, a.big_prompts, a.big_n, a.big_tokens, rounds=a.rounds)
    print(json.dumps(r, indent=2))
    from bench.common.results import write_result

    baseline = {"what": "the same small requests on the idle rollout, same run", "rows_key": "idle_p99_s"}
    write_result("fairness", [r], baseline=baseline, out=a.out or None, rollout=a.address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
