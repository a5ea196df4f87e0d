"""A pipeline stage's part of a multi-sender sync on the trainer side: export + pack against flat buckets.

Run under torchrun, tp ranks per pipeline stage (EP=1); each rank builds its stage (its TP shards) of a
Qwen2-shaped model (bench/common/models.py's MODELS) in `--param-dtype`, filled with random bits, and
times, over the buckets it owns (`Manifest.buckets_of(rank)` of the multi-sender layout):

- `iter`: its own per-tensor export (`export_own_tensors`) packed into two rotating buffers, what
  a stage did before (weightsync/publisher/multisender.py with the pipeline's pack);
- `flat`: `MegatronActor.own_flat_buckets` (flat_export.py over the rank's own buckets), what it does
  now: the parameters that are their own HF bytes live in the buckets, the rest is copied into
  their slots; `plan_s` is its first call (the plan, and moving the parameters), not in the median.
  At `--tp` > 1 the stage leader owns the buckets and the other TP ranks send it their shards in
  both passes (export.py's gathers for `iter`, tp_gather.py's exchange into the flat plan's buffers
  and slots for `flat`): their time is the leader's (they wait for it).

Each rank checks that both give the same bucket checksums. Rank 0 prints and writes (`--out`) the
median seconds per pass of every rank.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        -m bench flat_pp --model tiny --pp 2 --out /tmp
    python -m torch.distributed.run --standalone --nproc-per-node=2 -m bench flat_pp --model 7b --pp 2  # 2 GPUs
    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        -m bench flat_pp --model 7b --tp 2 --pp 1 --reps 5   # 2 GPUs
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402 (after the repo root is on the path)
import torch.distributed as dist  # noqa: E402


def make_actor(name: str, dtype: torch.dtype, pp: int, vpp: int, tp: int = 1):

    from bench.common.models import MODELS, qwen2_config
    from trainer_svc.actor.megatron.actor import MegatronActor

    cfg = qwen2_config(MODELS[name])
    actor = MegatronActor(cfg, tp=tp, pp=pp, vpp=vpp, params_dtype=dtype, export_dtype=dtype, init_weights=False)
    g = torch.Generator(device=actor.parameters()[0].device).manual_seed(actor.rank)
    with torch.no_grad():
        for p in actor.parameters():  # random bits: a wrong byte anywhere shows in the checksums
            p.view(-1).view(torch.uint8).copy_(
                torch.randint(0, 256, (p.numel() * p.element_size(),), dtype=torch.uint8, device=p.device, generator=g)
            )
    return actor


def rank_manifest(actor, bucket_bytes: int):
    from weightsync.bus.layout import layout_digest
    from weightsync.publisher.multisender import SendJob, sender_manifest

    job = SendJob(
        sync_id="bench", version=1, bucket_bytes=bucket_bytes, model_family=actor.family, checksum_algo="",
        origin="", digest="", targets={}, macs={}, timeout=1.0,
    )  # fmt: skip
    full = sender_manifest(actor.export_metas(), actor.export_owners(), job)
    mine = replace(full, buckets=full.buckets_of(actor.rank))
    return replace(mine, layout_digest=layout_digest(mine))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.pack import alloc_buffer, pack_bucket

    actor = make_actor(args.model, getattr(torch, args.param_dtype), args.pp, args.vpp, args.tp)
    dev = actor.parameters()[0].device
    m = rank_manifest(actor, args.bucket_mb << 20)
    # at TP > 1 only the stage leader owns buckets: the other TP ranks only send their shards
    bufs = [alloc_buffer(max(b.nbytes for b in m.buckets), dev) for _ in range(2)] if m.buckets else []

    def run_iter(check: bool):
        it, sums = iter(actor.export_own_tensors()), []
        for k, plan in enumerate(m.buckets):
            view = pack_bucket(plan, itertools.islice(it, len(plan.slots)), bufs[k % 2])
            if check:
                sums.append(bucket_checksum(view))
        for _ in it:  # a rank without buckets still takes part in its TP group's gathers
            pass
        _sync(dev)
        return sums

    def run_flat(check: bool):
        flats = actor.own_flat_buckets(m)
        if flats is None:
            raise RuntimeError(f"rank {actor.rank}: own_flat_buckets refused this layout (see the log)")
        _sync(dev)
        return [bucket_checksum(f[: b.nbytes]) for f, b in zip(flats, m.buckets)] if check else []

    want = run_iter(True)
    t0 = time.perf_counter()
    run_flat(False)  # the first call plans and moves the parameters
    plan_s = time.perf_counter() - t0
    got = run_flat(True)
    rec = {
        "rank": actor.rank,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "buckets": len(m.buckets),
        "bytes": sum(b.tensor_bytes for b in m.buckets),
        "exact": want == got,
        "plan_s": plan_s,
    }
    fe = actor.flat.plan  # None on a TP rank that only sends
    for key in (
        "aliased_bytes",
        "copied_bytes",
        "copies",
        "launches",
        "torch_copies",
        "received_bytes",
        "landed_bytes",
    ):
        rec[key] = getattr(fe, key, 0)
    for name, fn in (("iter", run_iter), ("flat", run_flat)):
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            fn(False)
            times.append(time.perf_counter() - t)
        rec[f"{name}_s"] = statistics.median(times)
    rec["exact_after"] = run_iter(True) == run_flat(True)
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, rec)
    if actor.rank == 0:
        out = {
            "model": args.model,
            "tp": args.tp,
            "pp": args.pp,
            "vpp": args.vpp,
            "param_dtype": args.param_dtype,
            "ranks": table,
        }
        print(json.dumps(out, indent=1))
        from bench.common.results import write_result

        rows = [{"rank": i, **r} for i, r in enumerate(out.pop("ranks"))]
        baseline = {"what": "the same rank's export + pack of its buckets (iter), same run", "rows_key": "iter_s"}
        write_result("flat_pp", rows, baseline=baseline, out=args.out or None, **out)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
