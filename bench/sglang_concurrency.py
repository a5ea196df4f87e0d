"""`bench/sglang_live.py --concurrency N`: N one-prompt greedy Generate calls at once against the same N one
after another, on the SGLang rollout and the built-in one (SGLang batches concurrent requests itself; the
built-in engine interleaves them step by step): tokens/s of each, and whether the answers agree."""

from __future__ import annotations

import functools
import json
import time
import traceback

from bench.sglang_fleet import log
from weightsync.v1 import rollout_pb2


def concurrency_run(res: dict, stubs: dict, prompts, clients: int, tokens: int) -> None:
    """`clients` one-prompt greedy Generate calls at once vs one after another, per engine (s0, b0)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(stub, k: int):
        req = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=prompts[k % len(prompts)])],
            sampling=rollout_pb2.SamplingParams(max_new_tokens=tokens, temperature=0.0, n=1),
        )
        return [list(x.token_ids) for x in stub.Generate(req, timeout=600).samples]

    for rid in ("s0", "b0"):
        rec = {"rollout": rid, "engine": "sglang" if rid.startswith("s") else "builtin", "clients": clients}
        res.setdefault("concurrency_runs", []).append(rec)
        try:
            stub = stubs[rid]
            one(stub, 0)  # warm-up
            t0 = time.perf_counter()
            seq = [one(stub, k) for k in range(clients)]
            rec["sequential_s"] = time.perf_counter() - t0
            with ThreadPoolExecutor(clients) as pool:
                t0 = time.perf_counter()
                conc = list(pool.map(functools.partial(one, stub), range(clients)))
                rec["concurrent_s"] = time.perf_counter() - t0
            n_tok = sum(len(ids) for out in seq for ids in out)
            rec["tokens"] = n_tok
            rec["sequential_tokens_per_s"] = n_tok / rec["sequential_s"]
            rec["concurrent_tokens_per_s"] = sum(len(i) for out in conc for i in out) / rec["concurrent_s"]
            rec["speedup"] = rec["sequential_s"] / rec["concurrent_s"]
            rec["same_tokens"] = conc == seq
            log(f"concurrency {rid}: {clients} clients x {tokens} tokens: {rec['speedup']:.2f}x sequential")
        except Exception as exc:  # noqa: BLE001 — recorded
            traceback.print_exc()
            rec["error"] = repr(exc)[:3000]


def print_concurrency(res: dict) -> None:
    for r in res.get("concurrency_runs", []):
        keys = ("rollout", "clients", "speedup", "concurrent_tokens_per_s", "same_tokens", "error")
        print(json.dumps({k: r.get(k) for k in keys}), flush=True)
