"""The trainer_writes write pass alone: plain copy_ against the fused copy-and-checksum kernel's configs.

On one GPU, for Qwen2.5-shaped models laid out as the sync lays them (1 GiB buckets: 7B = 15.2 GB in 15,
1.5B = 3.1 GB in 3; bf16), every variant runs in the same process on the same buffers:
- `copy_bucket`: one plain `copy_` per bucket (the bytes of the bucket into a buffer of its size);
- `copy_whole`: one `copy_` of all the bytes (the services bench's "one D2D copy");
- the config of weightsync/bus/copy/scatter_triton.CONFIGS the sync runs
  through `verified_copy.copy_all_into`, plus the read of every checksum (`pending_values`: the sync's
  flush); `<default>+prepared` the default as the trainer's `send_held` now runs it (per-tensor checks
  and table kept with the destinations: only the launch is left on the host).
Each variant is checked once (every destination tensor equal to its slot, every checksum equal to
`bucket_checksum`), then timed round-robin with the others: CUDA events from before the first launch to
after the last queued (`gpu_ms`: the host's queueing included, as the sync pays it), and host time to the
checksums read (`wall_ms`: the sync's flush included); medians after warm-up.
`ratio` = copy_whole / variant (the issue's target: >= 0.75 for the whole sync). Destinations are the
engine's tensors at 512-byte aligned addresses (as separate allocations are); `--dst-offset 4` shifts
them off the 16-byte boundary to time the single-word fallback.

    python3 -m bench verified_copy                          # GPU, < 3 min
    TRITON_INTERPRET=1 python3 -m bench verified_copy --tiny  # CPU check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common.results import write_result  # noqa: E402
from bench.model_shapes import CONFIGS  # noqa: E402

# the real shapes, and a tiny one for Triton's interpreter (odd widths: the kernels' tails)
MODELS = {"7b": CONFIGS["7b"], "1.5b": CONFIGS["1.5b"], "tiny": (64, 160, 2, 4, 2, 250, False)}


def _layout(model: str, bucket_bytes: int, dst_offset: int):
    import torch

    from bench.model_shapes import shapes_of
    from weightsync.bus.plan import TensorMeta, plan_buckets

    metas = [TensorMeta(n, s, torch.bfloat16) for n, s in shapes_of(MODELS[model])]
    plans = plan_buckets(metas, bucket_bytes)
    # destinations: one allocation, each tensor at a 512-byte boundary (+ dst_offset)
    dst_pos, pos = [], 0
    for p in plans:
        dst_pos.append([])
        for s in p.slots:
            dst_pos[-1].append(pos + dst_offset)
            pos += (s.meta.nbytes + dst_offset + 511) // 512 * 512
    return plans, dst_pos, pos


def run_model(model: str, args, device, configs) -> dict:
    import torch

    from weightsync.bus.copy import scatter_triton as scatter_cuda
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.copy.verified_copy import copy_all_into, pending_values

    plans, dst_pos, dst_bytes = _layout(model, args.bucket_mb << 20 if not args.tiny else 64 << 10, args.dst_offset)
    src_pos, pos = [], 0
    for p in plans:
        src_pos.append(pos)
        pos += (p.nbytes + 511) // 512 * 512
    total = sum(p.nbytes for p in plans)
    src = torch.empty(pos, dtype=torch.uint8, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    src.random_(0, 256, generator=gen)
    dst = torch.empty(max(dst_bytes, pos), dtype=torch.uint8, device=device)
    bufs = [src[o : o + p.nbytes] for o, p in zip(src_pos, plans)]
    dests = [
        [dst[o : o + s.meta.nbytes].view(torch.bfloat16).view(s.meta.shape) for o, s in zip(ds, p.slots)]
        for p, ds in zip(plans, dst_pos)
    ]
    want = [bucket_checksum(b) for b in bufs]
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def copy_bucket():
        for o, b in zip(src_pos, bufs):
            dst[o : o + b.numel()].copy_(b)

    def copy_whole():
        dst[:pos].copy_(src)

    # each variant queues its GPU work and returns what to finish after the end event (the checksums' read)
    variants = {"copy_bucket": copy_bucket, "copy_whole": copy_whole}
    for name, cfg in configs.items():
        variants[name] = (lambda c: lambda: copy_all_into(plans, bufs, dests, kernel=c))(cfg)
    for name in [n for n in configs if n == scatter_cuda.DEFAULT]:
        # as trainer_writes runs it: checks and table kept with the destinations (Destinations.prepared)
        keep: dict = {}
        variants[name + "+prepared"] = lambda c=configs[name], keep=keep: copy_all_into(
            plans, bufs, dests, kernel=c, prepared=keep
        )
        configs = {**configs, name + "+prepared": configs[name]}

    checks, errors = {}, {}
    for name, fn in variants.items():
        if name.startswith("copy_"):
            continue
        dst.zero_()
        try:
            got = pending_values(fn())
            sync()
        except Exception as exc:  # one config that fails (to compile) must not cost the others' numbers
            print(f"  {model} {name}: FAILED: {type(exc).__name__}: {exc}")
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        ok_sums = got == want
        ok_bytes = all(
            torch.equal(d.reshape(-1).view(torch.uint8), b[s.offset : s.offset + s.meta.nbytes])
            for p, b, ds in zip(plans, bufs, dests)
            for s, d in zip(p.slots, ds)
        )
        checks[name] = bool(ok_sums and ok_bytes)
        print(f"  {model} {name}: checksums {'ok' if ok_sums else 'WRONG'}, bytes {'ok' if ok_bytes else 'WRONG'}")

    variants = {n: fn for n, fn in variants.items() if n not in errors}
    times = {n: {"gpu_ms": [], "wall_ms": []} for n in variants}
    for rep in range(args.warmup + args.reps):
        for name, fn in variants.items():
            sync()
            t0 = time.perf_counter()
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            queued = fn()
            if cuda:
                e1.record()
            if queued is not None:
                pending_values(queued)  # the sync's flush: synchronize and read every checksum
            sync()
            wall = (time.perf_counter() - t0) * 1e3
            if rep >= args.warmup:
                times[name]["wall_ms"].append(wall)
                times[name]["gpu_ms"].append(e0.elapsed_time(e1) if cuda else wall)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    ref = med["copy_whole"]["gpu_ms"]
    rows = []
    for name in variants:
        g, w = med[name]["gpu_ms"], med[name]["wall_ms"]
        rows.append(
            {
                "variant": name,
                "gpu_s": g / 1e3,
                "wall_s": w / 1e3,
                "copy_s": ref / 1e3,
                "gpu_ms": round(g, 4),
                "wall_ms": round(w, 4),
                "tb_per_s": round(total / g / 1e9, 3) if g else None,
                "ratio_copy_whole_over_variant": round(ref / g, 3) if g else None,
                "correct": checks.get(name, True),
                "config": configs[name].__dict__ if name in configs else None,
                "gpu_ms_all": [round(x, 4) for x in times[name]["gpu_ms"]],
            }
        )
    return {
        "model": model,
        "bytes": total,
        "buckets": len(plans),
        "tensors": sum(len(p.slots) for p in plans),
        "rows": rows,
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="7b,1.5b")
    ap.add_argument("--configs", default="all", help="comma list of scatter_cuda.CONFIGS names, or all")
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dst-offset", type=int, default=0, help="bytes added to every destination address")
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (set TRITON_INTERPRET=1)")
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)

    import torch

    from weightsync.bus.copy import scatter_triton as scatter_cuda

    if args.tiny:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--tiny runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        args.models, args.reps, args.warmup = "tiny", min(args.reps, 2), 1
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --tiny with TRITON_INTERPRET=1 on the CPU")
        device = torch.device("cuda", torch.cuda.current_device())
    names = list(scatter_cuda.CONFIGS) if args.configs == "all" else args.configs.split(",")
    configs = {n: scatter_cuda.CONFIGS[n] for n in names}
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "default_config": scatter_cuda.DEFAULT,
        "args": vars(args),
    }
    print(f"# {meta['device']}, torch {meta['torch']}, {meta['date']}")
    results = []
    for model in args.models.split(","):
        r = run_model(model, args, device, configs)
        results.append(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the model's buffers, freed on return
        print(f"\n{model}: {r['bytes'] / 1e9:.2f} GB in {r['buckets']} buckets, {r['tensors']} tensors")
        print(f"{'variant':<26} {'gpu ms':>8} {'wall ms':>8} {'TB/s':>7} {'copy/var':>8}  ok")
        for row in r["rows"]:
            print(
                f"{row['variant']:<26} {row['gpu_ms']:8.3f} {row['wall_ms']:8.3f} {row['tb_per_s'] or 0:7.3f} "
                f"{row['ratio_copy_whole_over_variant'] or 0:8.3f}  {'yes' if row['correct'] else 'NO'}"
            )
    rows = [{"model": r["model"], "bytes": r["bytes"], **row} for r in results for row in r["rows"]]
    baseline = {"what": "one copy_ of all the bytes (copy_whole) on the same buffers, same run", "rows_key": "copy_s"}
    summary = [{k: v for k, v in r.items() if k != "rows"} for r in results]
    write_result(
        "verified_copy",
        rows,
        baseline=baseline,
        out=args.out or None,
        device="cpu" if device.type == "cpu" else None,
        models=summary,
        default_config=meta["default_config"],
        args=meta["args"],
    )
    return 0 if all(row["correct"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
