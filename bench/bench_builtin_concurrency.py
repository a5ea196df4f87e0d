"""The built-in engine under concurrent requests, without the services: where the time goes.

On an H200 (2026-11-26, bench/sglang_live.py --concurrency 16) 16 one-prompt greedy requests sent at once
to a built-in rollout took 51.5 s against 3.1 s one after another; on the CPU the same 16 threads take
about 1.4x. This runs the engine and its EngineGate in one process, 16 requests of 64 tokens, in the
variants that separate the suspects, and prints each variant's time and the gaps between decode steps:
- sequential, through the gate (the baseline);
- a new thread per request, each started once the one before ended (a thread's first use of the GPU);
- 16 threads taking turns (the rollout's behaviour);
- 16 threads taking turns but never handing over (turns cost nothing);
- 16 threads behind a plain lock, no gate (the gate is not involved);
- 16 threads taking turns with the interpreter's switch interval at 0.5 ms (a GIL convoy would shrink).
If none of them is slow, the cause is in the services (gRPC threads, admission, streaming), not the engine.

    python -m bench builtin_concurrency --device cuda:0        # a 0.5B-shaped random model, one GPU
    python -m bench builtin_concurrency --device cpu --hidden 64 --layers 2
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)
    import torch
    from transformers import Qwen2Config

    import rollout_svc.sync.engine_gate as gate_mod
    from bench.common import timing
    from bench.common.results import write_result
    from rollout_svc.engine.base import SamplingParams
    from rollout_svc.engine.builtin import BuiltinEngine
    from rollout_svc.sync.engine_gate import EngineGate

    cfg = Qwen2Config(
        vocab_size=151936, hidden_size=args.hidden, intermediate_size=4864, num_hidden_layers=args.layers,
        num_attention_heads=14 if args.hidden % 14 == 0 else 4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=True,
    )  # fmt: skip
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    engine = BuiltinEngine.from_config(cfg, dtype=dtype, device=args.device)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [7, 8, 9, 10, 11], [10, 11, 12, 13, 14, 15]]
    sampling = SamplingParams(max_new_tokens=args.tokens, temperature=0.0)

    rows = []

    def run(label: str, threads: bool, use_gate: bool = True, serial: bool = False) -> None:
        gate, lock, stamps = EngineGate(), threading.Lock(), []

        def one(k: int):
            if not use_gate:
                with lock:
                    return engine.generate([prompts[k % 3]], sampling)
            with gate.pinned(600.0) as turn:

                def step():
                    stamps.append(time.perf_counter())
                    turn()

                return engine.generate([prompts[k % 3]], sampling, step=step)

        one(0)  # warm-up
        stamps.clear()
        t0 = time.perf_counter()
        if threads:
            ths = [threading.Thread(target=one, args=(k,)) for k in range(args.requests)]
            for t in ths:
                t.start()
                if serial:
                    t.join()
            for t in ths:
                t.join()
        else:
            for k in range(args.requests):
                one(k)
        dt = time.perf_counter() - t0
        gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
        q = (lambda p: f"{gaps[int(p * (len(gaps) - 1))] * 1e3:.2f}") if gaps else (lambda p: "-")
        print(f"{label}: {dt:.3f} s; gap between steps ms p50 {q(0.5)} p90 {q(0.9)} max {q(1.0)}", flush=True)
        row = {"variant": label, "total_s": dt, "sequential_s": rows[0]["total_s"] if rows else dt}
        if gaps:
            row.update(step_gap_p50_s=timing.percentile(gaps, 50), step_gap_max_s=gaps[-1])
        rows.append(row)

    seen = []
    worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    print(f"intra-op threads: main {torch.get_num_threads()}, a new thread {seen[0]}", flush=True)
    run("sequential, through the gate", threads=False)
    run(f"{args.requests} threads, one after another", threads=True, serial=True)
    run(f"{args.requests} threads taking turns", threads=True)
    lead = gate_mod.MIN_LEAD_STEPS
    gate_mod.MIN_LEAD_STEPS = 1 << 30
    run(f"{args.requests} threads, turns without hand-over", threads=True)
    gate_mod.MIN_LEAD_STEPS = lead
    run(f"{args.requests} threads behind a plain lock", threads=True, use_gate=False)
    sys.setswitchinterval(0.0005)
    run(f"{args.requests} threads taking turns, switch interval 0.5 ms", threads=True)
    baseline = {"what": "the same requests one after another through the gate, same engine", "rows_key": "sequential_s"}
    device = "cpu" if args.device == "cpu" else None
    write_result("builtin_concurrency", rows, baseline=baseline, out=args.out or None, device=device, args=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
