"""The Megatron trainer's pack phase alone: its export into bucket buffers, old path against new.

One process, one rank (TP=PP=EP=1), a Qwen2-shaped model (bench_services.py's MODELS) built with
megatron-core in `--param-dtype` and filled with random bits, exported in the same dtype into
`--bucket-mb` buckets, three ways:

- `old`: the per-parameter export as it was before the flat export (each tensor cast, split with the
  rule's transform, `torch.cat`), then copied into a bucket by pack_bucket: what stream.pack timed;
- `iter`: today's per-tensor export (export.py: views where no conversion is needed, else one
  write), packed the same way: what the TCP / multi-sender / TP>1 paths do;
- `flat`: MegatronActor.flat_buckets (flat_export.py), the path of a one-GPU sync: the parameters
  that are their own HF bytes live in the buckets, the rest is written from an address table by a
  launch or two (weightsync/bus/copy_runs.py);
- `flat_torch`: the same with every converted copy left to torch (`_foreach_copy_`, one kernel per
  copy), the A/B of the table-driven launch.

Per path: median seconds per full pass over the model, the aten calls that move bytes (copy_,
cat, _to_copy, clone; a `_foreach_copy_` counts its tensors) and the bytes they write, counted in
a separate pass under a dispatch mode. Every path's buckets are checked byte for byte against
`old`'s (by checksum).

    python bench/bench_megatron_export.py --model 1.5b --reps 3 --out /tmp/export_cpu.json
    python bench/bench_megatron_export.py --model 7b --paths flat,flat_torch --out $OUT/export_gpu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402 (after the repo root is on the path)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

MOVING = {"copy_", "cat", "_to_copy", "clone", "_foreach_copy_", "index_select", "contiguous"}


class CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}
        self.written = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in MOVING:
            if name == "_foreach_copy_":
                n = len(args[0])
                self.written += sum(t.numel() * t.element_size() for t in args[0])
            else:
                n = 1
                res = args[0] if name == "copy_" else out
                self.written += res.numel() * res.element_size() if isinstance(res, torch.Tensor) else 0
            self.calls[name] = self.calls.get(name, 0) + n
        return out


def old_export(actor):
    """The per-parameter export as it was before the flat export, at TP=PP=EP=1 (export.py at
    da5cf95 without its collectives): cast, split, `torch.cat` of the one shard's pieces, trim."""
    from trainer_svc.actor.megatron.hf_meta import export_plan
    from trainer_svc.actor.megatron.model import named_parameters_global

    d = actor.spec.dims
    params = named_parameters_global(actor.model)
    for rule, site, names in export_plan(actor.spec):
        shard = params[rule.megatron_name(site)].detach().to(actor.export_dtype)
        per_rank = [rule.transform.to_hf(s, d) for s in [shard]]
        out = [torch.cat([pieces[i] for pieces in per_rank], dim=rule.tp_dim or 0) for i in range(len(names))]
        if rule.vocab:
            out = [t[: d.vocab_size] for t in out]
        yield from zip(names, out)


def make_actor(name: str, dtype: torch.dtype):

    from bench.bench_services import MODELS, qwen2_config
    from trainer_svc.actor.megatron.actor import MegatronActor

    cfg = qwen2_config(MODELS[name])
    actor = MegatronActor(cfg, params_dtype=dtype, export_dtype=dtype, init_weights=False)
    g = torch.Generator(device=actor.parameters()[0].device).manual_seed(0)
    with torch.no_grad():
        for p in actor.parameters():  # random bits: a wrong byte anywhere shows in the checksums
            p.view(-1).view(torch.uint8).copy_(
                torch.randint(0, 256, (p.numel() * p.element_size(),), dtype=torch.uint8, device=p.device, generator=g)
            )
    return actor


def pack_all(manifest, named, bufs):
    """Every bucket packed from `named` into the rotating `bufs` (as the pipeline); yields views."""
    from weightsync.bus.pack import pack_bucket

    it = iter(named)
    for k, plan in enumerate(manifest.buckets):
        yield pack_bucket(plan, itertools.islice(it, len(plan.slots)), bufs[k % len(bufs)])


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1.5b")
    ap.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--paths", default="old,iter,flat")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dtype = getattr(torch, args.param_dtype)
    from trainer_svc.actor.megatron.export import export_tensors
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.layout import ManifestCache
    from weightsync.bus.pack import alloc_buffer
    from weightsync.triton_support import available

    t0 = time.perf_counter()
    actor = make_actor(args.model, dtype)
    dev = actor.parameters()[0].device
    build_s = time.perf_counter() - t0
    manifest = ManifestCache().manifest(
        actor.export_metas(), version=1, sync_id="bench", bucket_bytes=args.bucket_mb << 20, model_family=actor.family
    )
    nbytes = sum(b.tensor_bytes for b in manifest.buckets)
    bufs = [alloc_buffer(max(b.nbytes for b in manifest.buckets), dev) for _ in range(2)]
    a = actor

    def run_old():
        it = old_export(a)
        return (
            [bucket_checksum(v) for v in pack_all(manifest, it, bufs)]
            if checking
            else [v.numel() for v in pack_all(manifest, it, bufs)]
        )

    def run_iter():
        it = export_tensors(a.model, a.spec, a.par, a.rmap, a.export_dtype, to_rank0=True)
        return (
            [bucket_checksum(v) for v in pack_all(manifest, it, bufs)]
            if checking
            else [v.numel() for v in pack_all(manifest, it, bufs)]
        )

    def run_flat():
        flats = a.flat_buckets(manifest)
        return [bucket_checksum(f[: b.nbytes]) for f, b in zip(flats, manifest.buckets)] if checking else flats

    paths = {"old": run_old, "iter": run_iter, "flat": run_flat, "flat_torch": run_flat}
    rec = {
        "model": args.model,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "param_dtype": args.param_dtype,
        "bytes": nbytes,
        "buckets": len(manifest.buckets),
        "tensors": manifest.num_tensors,
        "build_s": build_s,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "paths": {},
    }
    want = None
    for name in [p for p in args.paths.split(",") if p]:
        fn, r = paths[name], {}
        checking = False
        if name.startswith("flat"):
            from weightsync.bus.copy import copy_runs_triton as copy_runs_cuda

            # flat_torch: the same plan with every converted copy left to torch (one kernel each),
            # the A/B of the table-driven launch; planned afresh either way
            copy_runs_cuda.available = available if name == "flat" else (lambda: False)
            actor.flat.drop()
            t0 = time.perf_counter()
            fn()
            sync(dev)
            r["plan_s"] = time.perf_counter() - t0  # once per layout: moves the parameters into the buckets
            fe = actor.flat.plan
            r.update(
                aliased_bytes=fe.aliased_bytes,
                copied_bytes=fe.copied_bytes,
                batched_copies=fe.copies,
                launches=fe.launches,
                torch_copies=fe.torch_copies,
            )
        times = []
        for _ in range(args.reps + 1):
            sync(dev)
            t0 = time.perf_counter()
            fn()
            sync(dev)
            times.append(time.perf_counter() - t0)
        r["s_all"] = times[1:]  # the first is a warm-up
        r["s"] = statistics.median(times[1:])
        r["gbps"] = nbytes / r["s"] / 1e9
        counter = CountCopies()
        with counter:
            fn()
        r["copy_calls"] = counter.calls
        r["copy_calls_total"] = sum(counter.calls.values())
        r["bytes_written_per_byte"] = counter.written / nbytes
        checking = True
        got = fn()
        if want is None:
            want = got
        r["bit_exact_vs_first"] = got == want
        rec["paths"][name] = r
        print(
            f"{args.model} {name:>5}: {r['s'] * 1e3:9.1f} ms  {r['gbps']:7.2f} GB/s  copy calls "
            f"{r['copy_calls_total']:5d}  bytes written/byte {r['bytes_written_per_byte']:.2f}  "
            f"exact {r['bit_exact_vs_first']}",
            flush=True,
        )
    actor.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=1))
    return 0 if all(r["bit_exact_vs_first"] for r in rec["paths"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
