"""A rollout's CPU work per delta bucket, alone: the full checked copy into the engine vs the changed words.

One 16 MiB bucket of 16 bf16 tensors, `--density` of its words changed, encoded by the trainer's codec;
per repetition (median of `--reps`), on a fresh copy of the base:
- full:   apply_delta onto the base copy, then copy_into the engine's parameters (checksums the whole
          bucket as it copies it: the path a delta bucket took before, and takes on any fallback)
- sparse: apply_delta with the copy's word sums (the result's checksum from the words it overwrote),
          then only the changed words into the parameters (rollout_svc/sync/sparse_write.py)
Scaled to `--buckets` buckets (50: the 0.84 GB of bench_delta.py's `--shape 1.5b --layers 4`).

    OMP_NUM_THREADS=1 python -m bench delta_apply
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.common.results import write_result  # noqa: E402
from rollout_svc.sync.sparse_write import slot_words, write  # noqa: E402
from weightsync.bus.copy.checksum import word_sums  # noqa: E402
from weightsync.bus.copy.verified_copy import copy_into  # noqa: E402
from weightsync.bus.delta.codec import apply_delta, encode  # noqa: E402
from weightsync.bus.plan import TensorMeta, plan_buckets  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--buckets", type=int, default=50)
    ap.add_argument("--out", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    metas = [TensorMeta(f"w{i}", (1 << 19,), torch.bfloat16) for i in range(16)]
    (plan,) = plan_buckets(metas, 16 << 20)
    base = torch.randint(0, 256, (plan.nbytes,), dtype=torch.uint8)
    new = base.clone()
    w = new.view(torch.int16)
    pos = (torch.rand(w.numel()) < args.density).nonzero().squeeze(1)
    w[pos] ^= 0x21
    payload = encode(new, base, 2)
    sums = word_sums(base.view(torch.int32))
    params = [torch.empty(m.shape, dtype=m.dtype) for m in metas]
    for p, s in zip(params, plan.slots):
        p.view(-1).view(torch.uint8).copy_(base[s.offset : s.offset + s.meta.nbytes])

    def full():
        c = base.clone()
        t0 = time.perf_counter()
        apply_delta(payload, c)
        t1 = time.perf_counter()
        copy_into(plan, c, params)
        return t1 - t0, time.perf_counter() - t1

    def sparse():
        c = base.clone()
        t0 = time.perf_counter()
        applied = apply_delta(payload, c, sums)
        t1 = time.perf_counter()
        write(slot_words(plan, "bench", applied, c), params, 2)
        return t1 - t0, time.perf_counter() - t1

    out = {}
    for _ in range(2):  # alternated twice: the second round's numbers are kept
        for name, fn in (("full", full), ("sparse", sparse)):
            runs = [fn() for _ in range(args.reps)]
            apply_s = statistics.median(r[0] for r in runs)
            engine_s = statistics.median(r[1] for r in runs)
            out[name] = {
                "apply_s": apply_s,
                "into_engine_s": engine_s,
                "per_sync_s": (apply_s + engine_s) * args.buckets,
            }
    for name, r in out.items():
        print(
            f"{name}: per 16 MiB bucket apply {r['apply_s'] * 1e3:.2f} ms, into the engine "
            f"{r['into_engine_s'] * 1e3:.2f} ms; x{args.buckets} buckets: {r['per_sync_s']:.2f} s"
        )
    rows = [{"path": name, **r, "full_per_sync_s": out["full"]["per_sync_s"]} for name, r in out.items()]
    write_result(
        "delta_apply",
        rows,
        baseline={
            "what": "the full checked copy (path full) of the same bucket, same run",
            "rows_key": "full_per_sync_s",
        },
        out=args.out,
        device="cpu",
        machine=f"{platform.machine()} {os.cpu_count()} CPUs",
        density=args.density,
        changed_words=int(pos.numel()),
        bucket_bytes=plan.nbytes,
        payload_bytes=int(payload.numel()),
        buckets=args.buckets,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
