"""The built-in engine under concurrent requests: N at once against the same N one after another.

One process, no services: the engine and its EngineGate, each request on its own thread pinned as
the rollout service pins it (rollout_svc/sync/transaction.py serve_turns). Greedy requests of mixed
prompt lengths (3 to 12 tokens), `--tokens` new tokens each, on a Qwen2-shaped random model.
Variants, all in one run on one model:
- sequential: the requests one after another (the baseline, `sequential_s` in every row);
- concurrent: all at once; they share decode steps (rollout_svc/engine/batcher.py);
- concurrent, turns: all at once on the same weights with batch_requests=False (each request decodes
  alone and they take turns between steps: the engine before batching; skip with --no-turns).
Each concurrent variant's tokens are checked against the sequential ones (`same_tokens`, how many
requests differ, and the largest |log-prob| difference up to a request's first differing token).
A random model's greedy margins are within bf16 rounding (bench/peaked_model.py says why), so a
batched bf16 matmul may pick another token at a near-tie: --dtype float32 makes the check strict.
A result file per bench/results' schema is written (`--out`).

GPU (the figure the issue asks for: 16 concurrent >= 3x faster than sequential, same tokens):
    python -m bench builtin_concurrency --device cuda:0            # 0.5B-shaped, bf16, 16 x 64 tokens
    python -m bench builtin_concurrency --device cuda:0 --dtype float32 --no-turns --out X.json
CPU (a small shape; the default shape is hours on a CPU):
    python -m bench builtin_concurrency --device cpu --hidden 64 --layers 2 --intermediate 128
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common.results import write_result  # noqa: E402


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0", help="cuda:0 or cpu (default cuda:0)")
    ap.add_argument("--hidden", type=int, default=896, help="hidden size (default 896: Qwen2.5-0.5B)")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (default 24)")
    ap.add_argument("--intermediate", type=int, default=4864, help="MLP size (default 4864)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary (default 151936)")
    ap.add_argument("--requests", type=int, default=16, help="concurrent requests (default 16)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens a request (default 64)")
    ap.add_argument("--dtype", default="", help="float32 or bfloat16 (default: bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--no-turns", action="store_true", help="skip the batch_requests=False variant")
    ap.add_argument(
        "--out",
        default="",
        help="result file or directory (default bench/results/builtin_concurrency_<device>_<date>.json)",
    )
    return ap.parse_args(argv)


def _engine(args, batch_requests: bool):
    import torch
    from transformers import Qwen2Config

    from rollout_svc.engine.builtin import BuiltinEngine

    cfg = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=14 if args.hidden % 14 == 0 else 4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
    )  # fmt: skip
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else torch.bfloat16
        if args.device.startswith("cuda")
        else torch.float32
    )
    return BuiltinEngine.from_config(cfg, seed=0, dtype=dtype, device=args.device, batch_requests=batch_requests)


def _timed(engine, prompts, sampling, concurrent: bool):
    """(seconds, results per request) of every prompt as its own pinned request."""
    import torch

    from rollout_svc.sync.engine_gate import EngineGate

    gate = EngineGate()
    out: list = [None] * len(prompts)

    def one(k: int) -> None:
        with gate.pinned(600.0, takes_turns=not engine.batches_requests) as turn:
            out[k] = engine.generate([prompts[k]], sampling, step=turn)

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3600)
    else:
        for k in range(len(prompts)):
            one(k)
    sync()
    return time.perf_counter() - t0, out


def _compare(got, want) -> tuple[bool, float, int]:
    """(all tokens equal, the largest |log-prob| difference up to each request's first differing
    token, how many requests differ)."""
    worst, differ = 0.0, 0
    for g, w in zip(got, want):
        a, b = g[0], w[0]
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        differ += a.token_ids != b.token_ids
        worst = max([worst] + [abs(x - y) for x, y in zip(a.logprobs[: n + 1], b.logprobs[: n + 1])])
    return differ == 0, worst, differ


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)

    from rollout_svc.engine.base import SamplingParams

    prompts = [[(7 * k + j) % 1000 + 1 for j in range(3 + k % 10)] for k in range(args.requests)]
    sampling = SamplingParams(max_new_tokens=args.tokens, temperature=0.0)
    engine = _engine(args, batch_requests=True)
    _timed(engine, prompts[:2], sampling, concurrent=True)  # warm-up: kernels, the worker, allocator
    seq_s, want = _timed(engine, prompts, sampling, concurrent=False)
    print(f"sequential: {seq_s:.3f} s ({args.requests} x {args.tokens} tokens)", flush=True)
    rows = [dict(variant="sequential", time_s=seq_s, sequential_s=seq_s, speedup=1.0, same_tokens=True)]
    steps0 = engine._batcher.steps
    conc_s, got = _timed(engine, prompts, sampling, concurrent=True)
    same, worst, differ = _compare(got, want)
    steps = engine._batcher.steps - steps0
    rows.append(
        dict(variant="concurrent", time_s=conc_s, sequential_s=seq_s, speedup=seq_s / conc_s, same_tokens=same,
             requests_differing=differ, max_logprob_diff=worst, decode_steps=steps, widest_step=engine._batcher.widest)
    )  # fmt: skip
    print(f"concurrent: {conc_s:.3f} s, {seq_s / conc_s:.2f}x; same tokens {same} ({differ} requests differ), "
          f"max |dlogprob| {worst:.2e}; {steps} decode steps", flush=True)  # fmt: skip
    if not args.no_turns:
        turns = _engine(args, batch_requests=False)
        _timed(turns, prompts[:2], sampling, concurrent=True)
        t_s, got = _timed(turns, prompts, sampling, concurrent=True)
        same, worst, differ = _compare(got, want)
        rows.append(
            dict(variant="concurrent, turns (batch_requests=False)", time_s=t_s, sequential_s=seq_s,
                 speedup=seq_s / t_s, same_tokens=same, requests_differing=differ, max_logprob_diff=worst)
        )  # fmt: skip
        print(f"concurrent, turns: {t_s:.3f} s, {seq_s / t_s:.2f}x; same tokens {same}", flush=True)
    shape = dict(hidden=args.hidden, layers=args.layers, intermediate=args.intermediate, vocab=args.vocab)
    for r in rows:
        r.update(requests=args.requests, tokens=args.tokens, dtype=str(engine.dtype).removeprefix("torch."), **shape)
    write_result(
        "builtin_concurrency",
        rows,
        baseline={"what": "the same requests one after another on the same engine", "rows_key": "sequential_s"},
        out=args.out or None,
        device=args.device,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
