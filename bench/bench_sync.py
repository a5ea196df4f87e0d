"""Weight-sync benchmark on GPUs: our bus vs a raw NCCL broadcast and a per-tensor baseline.

Two processes (trainer on cuda:0, engine on cuda:1) that share nothing but an ncclUniqueId
(passed through a queue, as gRPC does in the services). For each synthetic Qwen2.5-shaped model
(random bf16 weights on the GPU) it measures, in the same run:
  raw      — NCCL broadcast of the same total bytes in 1 GiB messages (the interconnect ceiling)
  naive    — one broadcast per tensor straight into the engine's parameters (no buckets)
  bus      — plan → pack k+1 ║ broadcast k → engine unpack + copy into its parameters (our path),
             for several bucket sizes, with and without bucket checksums
  ipc      — colocated: trainer and engine processes on the *same* GPU, buckets shared by CUDA IPC
             handle, vs a device-to-device copy of the same bytes (the copy bound)
and the trainer's peak extra memory during the bus sync vs 2 buckets + the largest tensor.

    python -m bench bus --models 0.5b,7b,32b     # writes bench/results/bus_<device>_<date>.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common.results import write_result  # noqa: E402
from bench.model_shapes import shapes  # noqa: E402
from weightsync.bus.copy.checksum import ALGO, bucket_checksum  # noqa: E402
from weightsync.bus.nccl import libnccl  # noqa: E402
from weightsync.bus.nccl.group import NcclBucketReceiver, NcclBucketSender, NcclGroup  # noqa: E402
from weightsync.bus.pack import unpack_bucket  # noqa: E402
from weightsync.bus.pipeline import stream_buckets  # noqa: E402
from weightsync.bus.plan import TensorMeta, make_manifest  # noqa: E402

GiB = 1 << 30


def make_model(name, device, layers=None, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return {n: torch.randn(s, generator=g, device=device, dtype=torch.bfloat16) for n, s in shapes(name, layers)}


def matches_seed(model, name, device, layers, seed):
    """Regenerate the seed's tensors one at a time (a second full copy may not fit) and compare."""
    g = torch.Generator(device=device).manual_seed(seed)
    return all(
        torch.equal(torch.randn(s, generator=g, device=device, dtype=torch.bfloat16), model[n])
        for n, s in shapes(name, layers)
    )


def metas_of(name, layers=None):
    return [TensorMeta(n, s, torch.bfloat16) for n, s in shapes(name, layers)]


def _barrier(group, dev):
    group.broadcast(torch.zeros(1, dtype=torch.uint8, device=dev))
    torch.cuda.synchronize(dev)


def raw_broadcast_seconds(group, dev, total: int, reps: int) -> list[float]:
    """The ceiling: NCCL broadcasts of `total` bytes in 1 GiB messages, timed `reps` times after a warm-up."""
    chunk = torch.empty(min(GiB, total), dtype=torch.uint8, device=dev)
    times = []
    for rep in range(reps + 1):
        _barrier(group, dev)
        t0 = time.perf_counter()
        events = [group.enqueue(chunk[: min(GiB, total - off)], after_current=False) for off in range(0, total, GiB)]
        group.wait(events[-1], total)
        torch.cuda.synchronize(dev)
        if rep:
            times.append(time.perf_counter() - t0)
    return times


def run_rank(rank, uid_q, res_q, args):
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    if rank == 0:
        uid = libnccl.new_unique_id()
        uid_q.put(uid)
    else:
        uid = uid_q.get(timeout=60)
    group = NcclGroup(uid, 2, rank, dev, timeout=120)
    out = []
    for name in args.models:
        layers = args.layers_32b if name == "32b" and args.layers_32b else None
        model = make_model(name, dev, layers, seed=0 if rank == 0 else 1)
        total = sum(t.numel() * 2 for t in model.values())
        largest = max(t.numel() * 2 for t in model.values())
        rec = {"model": name, "layers": layers, "bytes": total, "tensors": len(model), "largest_tensor_bytes": largest}
        rec["raw_s"] = raw_broadcast_seconds(group, dev, total, args.reps)
        # naive: one broadcast per tensor into the destination parameter
        for rep in range(args.reps + 1):
            _barrier(group, dev)
            t0 = time.perf_counter()
            events = [group.enqueue(t.view(-1).view(torch.uint8), after_current=False) for t in model.values()]
            group.wait(events[-1], total)
            torch.cuda.synchronize(dev)
            if rep:
                rec.setdefault("naive_s", []).append(time.perf_counter() - t0)
        if rank == 1:  # the naive pass overwrote the engine's weights with the trainer's: re-randomise
            model = make_model(name, dev, layers, seed=1)
        # our bus
        for bucket_mb in args.bucket_mb:
            for csum in (False, True):
                key = f"bus_{bucket_mb}MiB" + ("_csum" if csum else "")
                manifest = make_manifest(
                    metas_of(name, layers),
                    version=1,
                    sync_id="bench",
                    bucket_bytes=bucket_mb << 20,
                    checksum_algo=ALGO if csum else "",
                )
                for rep in range(args.reps + 1):
                    _barrier(group, dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                    base = torch.cuda.memory_allocated(dev)
                    t0 = time.perf_counter()
                    if rank == 0:
                        stats = stream_buckets(
                            manifest,
                            iter(model.items()),
                            NcclBucketSender(group),
                            device=dev,
                            num_buffers=2,
                            with_checksums=csum,
                            timeout=300,
                        )
                        sums = stats.checksums
                    else:
                        rx = NcclBucketReceiver(group, manifest.buckets)
                        sums = []
                        for plan in manifest.buckets:
                            buf, _ = rx.recv(plan, timeout=300)
                            if csum:
                                sums.append(bucket_checksum(buf))
                            for n, v in unpack_bucket(plan, buf):
                                model[n].copy_(v, non_blocking=True)
                        del rx
                    torch.cuda.synchronize(dev)
                    if rep:
                        rec.setdefault(key + "_s", []).append(time.perf_counter() - t0)
                        if rank == 0:
                            rec.setdefault(key + "_peak_extra_bytes", []).append(
                                torch.cuda.max_memory_allocated(dev) - base
                            )
                if csum:
                    rec[key + "_checksums"] = sums[:3]
        if rank == 1:  # exactness: after the last bus sync the engine holds the trainer's seed-0 weights
            rec["exact"] = matches_seed(model, name, dev, layers, seed=0)
        out.append(rec)
        del model
        torch.cuda.empty_cache()
    group.close()
    res_q.put((rank, out))


def ipc_rank(role, q_push, q_ack, res_q, args, name):
    from weightsync.bus.ipc.handles import IpcBucketSender, mapped_ipc_bucket
    from weightsync.v1 import bus_pb2

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    layers = args.layers_32b if name == "32b" and args.layers_32b else None
    model = make_model(name, dev, layers, seed=0 if role == "trainer" else 1)
    manifest = make_manifest(metas_of(name, layers), version=1, sync_id="ipc", bucket_bytes=args.ipc_bucket_mb << 20)
    total = manifest.total_bytes
    res = {"model": name, "bytes": total}
    for rep in range(args.reps + 1):
        if role == "trainer":
            q_ack.get(timeout=120)  # engine ready
            t0 = time.perf_counter()

            def push(plan, handle, checksum):
                q_push.put((plan.index, handle.SerializeToString()))
                q_ack.get(timeout=120)

            stream_buckets(
                manifest,
                iter(model.items()),
                IpcBucketSender(push),
                device=dev,
                num_buffers=args.ipc_buffers,
                with_checksums=False,
                timeout=300,
            )
            q_push.put(None)
            q_ack.get(timeout=120)  # engine done
            if rep:
                res.setdefault("ipc_s", []).append(time.perf_counter() - t0)
        else:
            q_ack.put("ready")
            while True:
                item = q_push.get(timeout=120)
                if item is None:
                    torch.cuda.synchronize(dev)
                    q_ack.put("done")
                    break
                index, blob = item
                plan = manifest.buckets[index]
                with mapped_ipc_bucket(bus_pb2.CudaIpcHandle.FromString(blob), plan.nbytes) as buf:
                    for n, v in unpack_bucket(plan, buf):
                        model[n].copy_(v, non_blocking=True)
                q_ack.put("ack")
    if role == "trainer":
        del model  # the engine process still holds its copy: measure the copy bound on 4 GiB and scale
        n = min(total, 4 * GiB)
        flat = torch.empty(n, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(flat)
        for _ in range(3):
            dst.copy_(flat)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            dst.copy_(flat)
        torch.cuda.synchronize()
        res["copy_bound_s"] = (time.perf_counter() - t0) / 10 * total / n
    else:
        res["exact"] = matches_seed(model, name, dev, layers, seed=0)
    res_q.put((role, res))


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="0.5b,7b,32b")
    p.add_argument("--bucket-mb", default="64,256,1024")
    p.add_argument("--ipc-bucket-mb", type=int, default=1024)
    p.add_argument("--ipc-models", default="7b")
    p.add_argument("--ipc-buffers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers-32b", type=int, default=0, help="trim the 32B config to this many layers (0 = all 64)")
    p.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.bucket_mb = [int(x) for x in args.bucket_mb.split(",")]
    ctx = mp.get_context("spawn")
    results = {
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "nccl": libnccl.version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }  # for print_table; the file is written by write_result
    if torch.cuda.device_count() >= 2:
        uid_q, res_q = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=run_rank, args=(r, uid_q, res_q, args)) for r in range(2)]
        for pr in procs:
            pr.start()
        got = dict(res_q.get(timeout=560) for _ in procs)
        for pr in procs:
            pr.join(30)
        merged = []
        for s, r in zip(got[0], got[1]):  # times are taken on the receiver's clock: it finishes last
            rec = dict(s, exact=r.get("exact"))
            rec.update({k + "_rx": v for k, v in r.items() if k.endswith("_s")})
            merged.append(rec)
        results["nccl_1to1"] = merged
    for name in [m for m in args.ipc_models.split(",") if m]:
        q_push, q_ack, res_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        procs = [
            ctx.Process(target=ipc_rank, args=(role, q_push, q_ack, res_q, args, name))
            for role in ("trainer", "engine")
        ]
        for pr in procs:
            pr.start()
        got = dict(res_q.get(timeout=300) for _ in procs)
        for pr in procs:
            pr.join(30)
        results.setdefault("ipc", []).append({**got["trainer"], "exact": got["engine"]["exact"]})
    buf = torch.randint(0, 256, (GiB,), dtype=torch.uint8, device="cuda:0")
    for _ in range(2):
        bucket_checksum(buf)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        bucket_checksum(buf)
    results["checksum_gbps"] = GiB * 5 / (time.perf_counter() - t0) / 1e9
    del buf
    print_table(results)
    extra = {k: results[k] for k in ("nccl", "nccl_1to1", "ipc", "checksum_gbps") if k in results}
    write_result("bus", rows_of(results), baseline=BASELINE, out=args.out or None, gpus=results["gpus"], **extra)
    return 0


BASELINE = {
    "what": "nccl rows: a raw NCCL broadcast of the same bytes in 1 GiB messages; ipc rows: one D2D copy of them",
    "rows_key": "bound_s",
}


def rows_of(results: dict) -> list[dict]:
    """One row per model and path: its median seconds (the receiver's clock) against the bound of the same run."""
    rows = []
    for rec in results.get("nccl_1to1", []):
        raw = median(rec["raw_s_rx"])
        for key in ["naive"] + [k[:-5] for k in rec if k.startswith("bus_") and k.endswith("_s_rx")]:
            t = median(rec[key + "_s_rx"])
            peak = rec.get(key + "_peak_extra_bytes")
            row = {"model": rec["model"], "transport": "nccl", "path": key, "sync_s": t, "bound_s": raw}
            row.update(ratio=raw / t, bytes=rec["bytes"], exact=rec.get("exact"))
            if peak:
                row["peak_extra_bytes"] = max(peak)
            rows.append(row)
    for rec in results.get("ipc", []):
        t, bound = median(rec["ipc_s"]), rec["copy_bound_s"]
        row = {"model": rec["model"], "transport": "ipc", "path": "ipc", "sync_s": t, "bound_s": bound}
        rows.append({**row, "ratio": bound / t, "bytes": rec["bytes"], "exact": rec["exact"]})
    return rows


def print_table(results):
    print(
        f"\n{results['device']} x{results['gpus']}  NCCL {results['nccl']}  torch {results['torch']}  {results['date']}"
    )
    for rec in results.get("nccl_1to1", []):
        gb = rec["bytes"] / 1e9
        raw = median(rec["raw_s_rx"])
        print(
            f"\n{rec['model']}: {gb:.2f} GB in {rec['tensors']} tensors (largest "
            f"{rec['largest_tensor_bytes'] / 2**20:.0f} MiB)"
            f"  engine weights exact after sync: {rec.get('exact')}"
        )
        print(f"  {'path':<22}{'seconds':>9}{'GB/s':>8}{'vs raw':>8}{'peak extra MiB':>16}")
        for key in ["raw", "naive"] + [k[:-5] for k in rec if k.startswith("bus_") and k.endswith("_s_rx")]:
            t = median(rec[key + "_s_rx"])
            peak = rec.get(key + "_peak_extra_bytes")
            print(
                f"  {key:<22}{t:>9.4f}{gb / t:>8.1f}{raw / t:>8.3f}"
                f"{(max(peak) / 2**20 if peak else float('nan')):>16.0f}"
            )
    print(f"\nbucket checksum on {results['device']}: {results.get('checksum_gbps', 0):.0f} GB/s")
    for rec in results.get("ipc", []):
        t, bound = median(rec["ipc_s"]), rec["copy_bound_s"]
        print(
            f"\nIPC colocated {rec['model']}: {rec['bytes'] / 1e9:.2f} GB in {t:.4f}s "
            f"({rec['bytes'] / 1e9 / t:.0f} GB/s); "
            f"one D2D copy {bound:.4f}s; ratio to copy bound {bound / t:.3f}; exact {rec['exact']}"
        )


if __name__ == "__main__":
    sys.exit(main())
