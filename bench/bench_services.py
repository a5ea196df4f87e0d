"""End-to-end weight-sync benchmark through the real services (trainer-svc -> rollout-svc).

Timed: one `Sync` RPC, from the call until every rollout has committed. `seconds` is the trainer's
figure (prepare on every rollout -> stream every bucket -> commit on every rollout); `wall_s` is the
client's time around the RPC. Per model (a Qwen2-shaped config.json; the trainer's `--init-seed`
makes the weights): a `--backend hf|megatron` trainer (parameters in `--param-dtype`, by default
the export dtype: a bf16 trainer, the real case) and `--rollouts` rollouts (`--apply-mode inplace`),
one sync after start (it builds the NCCL group; `first_sync_s`), then `--reps` timed syncs, all of the same version:
the trainer cannot cheaply bump its version (LoadWeights needs a checkpoint on disk, TrainStep
optimizer memory), and a sync at the same version still streams every byte and commits a new sync
id on every rollout, whose GetStatus must then report the synced version. With `--transport nccl`,
once the services are stopped, a raw NCCL broadcast of the same bytes in 1 GiB messages from
cuda:0 to the rollouts' GPUs (cuda:1..cuda:N; the `bus` bench's technique) gives the ceiling;
with `--transport ipc`, one device-to-device copy of the same bytes on the same GPU, in this process;
ratio = raw_s / sync_s.
Phases: plan, prepare, stream, commit, and within stream (overlapping the sends) stream.export —
the trainer's gather and convert — and stream.pack (export + pack + checksum per bucket).

Without --out a run is written to bench/results/services_<device>_<date>.json (bench/common/results.py).

    python -m bench services --models 0.5b,1.5b,7b                              # >= 2 GPUs
    python -m bench services --models 7b --transport ipc                        # 1 GPU, colocated
    python -m bench services --models 7b --transport ipc --export-dtypes bfloat16,fp8-block
    python -m bench services --models 7b,1.5b --transport ipc --backend megatron \
        --export-dtypes bfloat16,fp8-block --ipc-direction trainer_writes --reps 10    # FP8 written by the trainer
    python -m bench services --models 1.5b,7b --backend megatron
    OMP_NUM_THREADS=1 python -m bench services --models tiny --transport tcp --reps 2 --out /tmp
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Required on the GPU hosts (NVLink multicast must stay off there); the services inherit them.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
# The services initialise their random weights on the CPU: give each a few threads on GPU hosts.
os.environ.setdefault("WS_LOCAL_OMP_THREADS", "8")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# The services run as `python -m trainer_svc` / `-m rollout_svc`: make them import this checkout.
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.bench_sync import raw_broadcast_seconds  # noqa: E402
from bench.common.models import MODELS, write_config  # noqa: E402,F401  (write_config: bench/sglang_live.py)
from bench.common.results import write_result  # noqa: E402
from weightsync.control.client import channel, describe_rpc_error, rollout_stub, trainer_stub  # noqa: E402
from weightsync.local.procs import start_rollout, start_trainer, wait_registered  # noqa: E402
from weightsync.v1 import rollout_pb2, trainer_pb2  # noqa: E402


def rollout_device(args, i: int) -> str:
    # NCCL takes one rank per GPU, so each rollout needs a GPU of its own besides the trainer's.
    return {"nccl": f"cuda:{1 + i}", "ipc": args.device_trainer, "tcp": "cpu"}[args.transport]


def run_model(name: str, args, work: Path, export_dtype: str) -> dict:
    model_dir = work / name if (work / name).is_dir() else write_config(name, work)
    logs = work / f"{name}-{export_dtype}-logs"
    logs.mkdir()
    procs, channels = [], []
    try:
        # megatron places itself on cuda:LOCAL_RANK (cuda:0 here); hf goes where --device-trainer says
        where = ("--device", args.device_trainer) if args.backend == "hf" else ()
        t = start_trainer(
            logs,
            "--backend",
            args.backend,
            "--model",
            str(model_dir),
            "--init-seed",
            "1",
            *where,
            "--param-dtype",
            args.param_dtype,
            "--transport",
            args.transport,
            "--export-dtype",
            export_dtype,
            "--bucket-mb",
            str(args.bucket_mb),
            "--sync-timeout-s",
            str(args.sync_timeout),
            "--no-auto-sync-new-rollouts",
            *(() if args.sync_link == "on" else ("--no-sync-link",)),
            *(("--ipc-direction", args.ipc_directions[0]) if args.transport == "ipc" else ()),
        )
        procs.append(t)
        ids = [f"r{i}" for i in range(args.rollouts)]
        # Started alongside the trainer so that the (slow, CPU) inits overlap; a rollout keeps
        # retrying its registration until the trainer answers, up to --register-timeout-s.
        for i, rid in enumerate(ids):
            procs.append(
                start_rollout(
                    logs,
                    "--model",
                    str(model_dir),
                    "--init-seed",
                    "2",
                    "--device",
                    rollout_device(args, i),
                    "--dtype",
                    args.dtype,
                    "--apply-mode",
                    "inplace",
                    "--trainer-address",
                    t.address,
                    "--register-timeout-s",
                    str(args.ready_timeout),
                    "--sync-timeout-s",
                    str(args.sync_timeout),
                    name=rid,
                )
            )
        deadline = time.monotonic() + args.ready_timeout
        for p in procs:
            p.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
        channels = [channel(p.address) for p in procs]
        tstub = trainer_stub(channels[0], "", 30)
        rstubs = {rid: rollout_stub(ch, "", 30) for rid, ch in zip(ids, channels[1:])}
        wait_registered(t.address, ids, max(1.0, deadline - time.monotonic()))
        status = lambda: {rid: s.GetStatus(rollout_pb2.GetStatusRequest()) for rid, s in rstubs.items()}  # noqa: E731
        # version 0 = never synced, so the first check shows that the warm-up really committed
        rec = {
            "model": name,
            "export_dtype": export_dtype,
            "rollout_devices": [rollout_device(args, i) for i in range(args.rollouts)],
            "rollout_versions_before": {rid: st.version for rid, st in status().items()},
            "syncs": [],
        }
        # several directions: each warmed up once, then their timed syncs alternate (one run, the same
        # services and weights: each is the other's baseline)
        asked = args.ipc_directions if args.transport == "ipc" and len(args.ipc_directions) > 1 else [""]
        plan = [(True, d) for d in asked] + [(False, d) for _ in range(args.reps) for d in asked]
        for warmup, want in plan:
            t0 = time.perf_counter()
            report = tstub.Sync(
                trainer_pb2.SyncRequest(timeout_seconds=args.sync_timeout, ipc_direction=want),
                timeout=args.sync_timeout + 60,
            ).report
            wall = time.perf_counter() - t0
            if not report.ok:
                errs = "; ".join(f"{r.rollout_id}: {r.error}" for r in report.rollouts if not r.ok)
                raise RuntimeError(f"sync {report.sync_id} failed: {errs or 'no rollout targeted'}")
            st = status()
            rec["syncs"].append(
                {
                    "warmup": warmup,
                    "asked": want,
                    "sync_id": report.sync_id,
                    "version": report.version,
                    "seconds": report.seconds,
                    "wall_s": wall,
                    "bytes": report.bytes,
                    "num_buckets": report.num_buckets,
                    "num_tensors": report.num_tensors,
                    "gbps": report.gbps,
                    "transport": report.transport,
                    "phase_seconds": dict(report.phase_seconds),
                    # ipc: the trainer wrote into the engine (it reports that phase) or the rollout read
                    "direction": direction_of(report),
                    "rollout_versions": {rid: x.version for rid, x in st.items()},
                    "rollout_checksums": {rid: f"{x.weights_checksum:016x}" for rid, x in st.items()},
                    "rollouts_on_version": all(
                        x.version == report.version and x.state == rollout_pb2.SERVING for x in st.values()
                    ),
                }
            )
        if args.transport == "nccl":  # 1 = the warm-up's group carried every timed sync
            rec["trainer_nccl_group_builds"] = t.metric("weightsync_nccl_group_builds_total", 'role="trainer"')
        groups = {d: summary([s for s in rec["syncs"] if s["asked"] == d]) for d in asked}
        rec.update(groups[asked[0]])  # the first direction's figures at the top (one direction: all of them)
        rec["rollouts_on_version"] = all(s["rollouts_on_version"] for s in rec["syncs"])
        if len(asked) > 1:
            rec["by_direction"] = groups
        return rec
    except BaseException:
        for p in procs:
            print(f"----- {p.name} log (tail, {p.log_path}) -----\n{p.log()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for ch in channels:
            ch.close()
        for p in procs:
            p.stop()


def summary(syncs: list[dict]) -> dict:
    """Medians of the timed syncs among `syncs` (the first one, a warm-up, gives first_sync_s)."""
    timed = [s for s in syncs if not s["warmup"]]
    out = dict(
        bytes=timed[0]["bytes"],
        num_buckets=timed[0]["num_buckets"],
        first_sync_s=syncs[0]["seconds"],
        sync_s=statistics.median(s["seconds"] for s in timed),
        wall_s=statistics.median(s["wall_s"] for s in timed),
        directions=sorted({s["direction"] for s in timed}),
        phase_s={
            k: statistics.median(s["phase_seconds"].get(k, 0.0) for s in timed) for k in timed[0]["phase_seconds"]
        },
    )
    out["gbps"] = out["bytes"] / out["sync_s"] / 1e9
    return out


def direction_of(report) -> str:
    """Who moved the bytes of a sync: trainer_writes, rollout_reads (ipc) or the transport's name."""
    if report.transport != "ipc":
        return report.transport
    return "trainer_writes" if "stream.trainer_writes" in report.phase_seconds else "rollout_reads"


def d2d_copy_seconds(nbytes: int, reps: int, device: str) -> list[float]:
    """One device-to-device copy of `nbytes` on one GPU: the bound of a colocated (IPC) sync, which
    must at least move every byte once into the engine's memory. Same process, same run."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out = []
    for i in range(reps + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        if i:  # the first copy is a warm-up
            out.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return out


def raw_rank(rank: int, world: int, uid_q, res_q, sizes: list[int], reps: int) -> None:
    from weightsync.bus.nccl import libnccl
    from weightsync.bus.nccl.group import NcclGroup

    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    uid = libnccl.new_unique_id() if rank == 0 else uid_q.get(timeout=60)
    if rank == 0:
        for _ in range(world - 1):
            uid_q.put(uid)
    group = NcclGroup(uid, world, rank, dev, timeout=120)
    out = [raw_broadcast_seconds(group, dev, total, reps) for total in sizes]
    group.close()
    res_q.put((rank, out))


def raw_nccl(sizes: list[int], reps: int, timeout: float, receivers: int = 1) -> list[list[float]]:
    """A raw NCCL broadcast of each size from cuda:0 to cuda:1..cuda:`receivers` (the services' GPUs)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    uid_q, res_q = ctx.Queue(), ctx.Queue()
    world = 1 + receivers
    procs = [ctx.Process(target=raw_rank, args=(r, world, uid_q, res_q, sizes, reps)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(res_q.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    # the receivers' clocks, as in bench_sync: they finish last; with several, the slowest of them per rep
    return [max(times) for times in zip(*(got[r] for r in range(1, world)))]


def _exit_on_sigterm() -> None:
    """`timeout` (bench/run_*.sh) ends a run with SIGTERM, which would leave the services running (and
    holding the GPU and the CPUs under the next run): exit through `finally`, which stops them."""
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    _exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="0.5b,1.5b,7b", help=f"comma list of {','.join(MODELS)}")
    ap.add_argument("--transport", choices=("nccl", "ipc", "tcp"), default=None, help="default nccl on GPU, else tcp")
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="the rollout engines' dtype (and the trainer's export dtype unless --export-dtypes)",
    )
    ap.add_argument(
        "--export-dtypes",
        default="",
        help="comma list of trainer export dtypes to run per model, e.g. bfloat16,fp8-block "
        "(fp8-block: block-FP8 linear weights, dequantized by the rollout, or with --ipc-direction "
        "trainer_writes by the trainer straight into the engine); default --dtype",
    )
    ap.add_argument(
        "--backend",
        choices=("hf", "megatron"),
        default="hf",
        help="trainer backend: megatron (megatron-core GPTModel on cuda:0, the real case) or hf",
    )
    ap.add_argument(
        "--param-dtype",
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="trainer parameter dtype (default: --dtype, so nothing is cast while streaming; "
        "float32 with --dtype bfloat16 measures a cast on every sync)",
    )
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument(
        "--ipc-direction",
        default="auto",
        help="transport ipc: the trainer's ipc_direction, auto, rollout_reads or trainer_writes (auto: the trainer "
        "writes into the engine where it can); a comma list, e.g. trainer_writes,rollout_reads, runs each in the "
        "same services, their timed syncs alternating (SyncRequest.ipc_direction), each reported on its own",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rollouts", type=int, default=1)
    ap.add_argument("--device-trainer", default=None, help="default cuda:0 (cpu with --transport tcp)")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="start-up + registration bound per model (s)")
    ap.add_argument("--sync-timeout", type=float, default=600.0, help="bound on one sync (s)")
    ap.add_argument(
        "--sync-link",
        choices=("on", "off"),
        default="on",
        help="off: the trainer sends PrepareSync / CommitSync as gRPC calls (the baseline of the sync link)",
    )
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/, the schema's name)")
    args = ap.parse_args(argv)
    args.transport = args.transport or ("nccl" if torch.cuda.is_available() else "tcp")
    args.param_dtype = args.param_dtype or args.dtype
    args.ipc_directions = [d for d in args.ipc_direction.split(",") if d]
    bad = [d for d in args.ipc_directions if d not in ("auto", "rollout_reads", "trainer_writes")]
    if bad or not args.ipc_directions or len(set(args.ipc_directions)) != len(args.ipc_directions):
        ap.error(f"--ipc-direction {args.ipc_direction!r}: distinct values among auto, rollout_reads, trainer_writes")
    args.device_trainer = args.device_trainer or ("cpu" if args.transport == "tcp" else "cuda:0")
    models = [m for m in args.models.split(",") if m]
    export_dtypes = [d for d in args.export_dtypes.split(",") if d] or [args.dtype]
    bad_dtypes = [d for d in export_dtypes if d not in ("bfloat16", "float16", "float32", "fp8-block")]
    if bad_dtypes:
        ap.error(f"--export-dtypes: {bad_dtypes} not among bfloat16, float16, float32, fp8-block")
    unknown = [m for m in models if m not in MODELS]
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if unknown or args.reps < 1 or args.rollouts < 1:
        ap.error(f"unknown models {unknown}" if unknown else "--reps and --rollouts must be >= 1")
    if args.transport == "nccl" and ngpu < 1 + args.rollouts:
        ap.error(f"--transport nccl with {args.rollouts} rollout(s) needs {1 + args.rollouts} GPUs, found {ngpu}")
    results = {
        "device": torch.cuda.get_device_name(0) if ngpu else "cpu",
        "gpus": ngpu,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": vars(args),
        "models": [],
    }
    work = Path(tempfile.mkdtemp(prefix="bench_services-"))
    failed = False
    for name in models:
        for export_dtype in export_dtypes:
            try:
                rec = run_model(name, args, work, export_dtype)
            except Exception as exc:  # the other models still run; the logs above say why
                err = describe_rpc_error(exc) if isinstance(exc, grpc.RpcError) else f"{type(exc).__name__}: {exc}"
                print(f"{name} ({export_dtype}): FAILED: {err}", file=sys.stderr)
                rec, failed = {"model": name, "export_dtype": export_dtype, "error": err}, True
            results["models"].append(rec)
    by = {(r["model"], r["export_dtype"]): r for r in results["models"] if "error" not in r}
    for (name, dt), r in by.items():  # same run, same model: how FP8 compares with the bf16 sync
        base = by.get((name, "bfloat16"))
        if dt == "fp8-block" and base:
            r["vs_bfloat16"] = {"time": r["sync_s"] / base["sync_s"], "bytes": r["bytes"] / base["bytes"]}
    ok = [r for r in results["models"] if "error" not in r]
    if args.transport == "nccl" and ok:
        from weightsync.bus.nccl import libnccl

        results["nccl"] = libnccl.version()
        try:
            raw = raw_nccl([r["bytes"] for r in ok], args.reps, timeout=600, receivers=args.rollouts)
        except Exception as exc:  # keep the services' numbers
            print(f"raw NCCL broadcast FAILED: {exc!r}", file=sys.stderr)
            results["raw_error"], raw, failed = repr(exc), [], True
        for r, times in zip(ok, raw):
            kind = f"nccl broadcast, 1 GiB messages, 1 -> {args.rollouts} GPU(s)"
            r.update(raw_s_all=times, raw_s=statistics.median(times), raw_kind=kind)
            r["ratio"] = r["raw_s"] / r["sync_s"]
    if args.transport == "ipc" and ok:
        for r in ok:  # the services are stopped: their memory is free again
            try:
                times = d2d_copy_seconds(r["bytes"], args.reps, args.device_trainer)
            except Exception as exc:  # keep the services' numbers
                print(f"D2D copy bound FAILED: {exc!r}", file=sys.stderr)
                results["raw_error"], failed = repr(exc), True
                continue
            r.update(raw_s_all=times, raw_s=statistics.median(times), raw_kind="one D2D copy of the bytes")
            r["ratio"] = r["raw_s"] / r["sync_s"]
            for g in r.get("by_direction", {}).values():
                g["ratio"] = r["raw_s"] / g["sync_s"]
    write_result(
        "services",
        rows_of(results["models"]),
        baseline=BOUNDS.get(args.transport),
        out=args.out or None,
        args=vars(args),
        gpus=ngpu,
        **{k: results[k] for k in ("nccl", "raw_error") if k in results},
    )
    print_table(results)
    if failed:
        print(f"logs kept under {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed or not all(r["rollouts_on_version"] for r in ok) else 0


BOUNDS = {
    "ipc": {"what": "one device-to-device copy of the same bytes on the same GPU", "rows_key": "bound_s"},
    "nccl": {"what": "a raw NCCL broadcast of the same bytes, 1 GiB messages, cuda:0 -> cuda:1", "rows_key": "bound_s"},
}


def rows_of(models: list[dict]) -> list[dict]:
    """One row per model, export dtype and IPC direction: the sync's median against the bound of the same run."""
    rows = []
    for r in models:
        head = {"model": r["model"], "export_dtype": r["export_dtype"]}
        if "error" in r:
            rows.append({**head, "error": r["error"]})
            continue
        groups = r.get("by_direction")
        for asked, g in (groups or {"": r}).items():
            row = {**head, "direction": ",".join(g["directions"]), "sync_s": g["sync_s"], "wall_s": g["wall_s"]}
            if "raw_s" in r:
                row.update(bound_s=r["raw_s"], ratio=r["raw_s"] / g["sync_s"], bound_samples_s=r["raw_s_all"])
            row.update(
                bytes=g["bytes"],
                num_buckets=g["num_buckets"],
                first_sync_s=g["first_sync_s"],
                phase_s=g["phase_s"],
                syncs=[s for s in r["syncs"] if not groups or s["asked"] == asked],
            )
            if "vs_bfloat16" in r:
                row["vs_bfloat16"] = r["vs_bfloat16"]
            rows.append(row)
    return rows


def print_table(results: dict) -> None:
    a = results["args"]
    print(
        f"\n{results['device']}  torch {results['torch']}  {results['date']}  transport {a['transport']}  "
        f"{a['dtype']}  bucket {a['bucket_mb']} MiB  {a['rollouts']} rollout(s)  median of {a['reps']}  "
        f"trainer {a['backend']} {a['param_dtype']}"
    )
    print(
        f"{'model':<7}{'export':>10}{'GB':>8}{'buckets':>9}{'sync s':>10}{'wall s':>10}"
        f"{'GB/s':>8}{'raw s':>10}{'ratio':>8}"
        f"  rollouts on version"
    )
    for r in results["models"]:
        if "error" in r:
            print(f"{r['model']:<7}{r.get('export_dtype', ''):>10}  FAILED: {r['error'].splitlines()[0][:100]}")
            continue
        for g in r.get("by_direction", {"": r}).values():
            raw = f"{r['raw_s']:>10.4f}{r['raw_s'] / g['sync_s']:>8.3f}" if "raw_s" in r else f"{'n/a':>10}{'n/a':>8}"
            print(
                f"{r['model']:<7}{r['export_dtype']:>10}{g['bytes'] / 1e9:>8.3f}{g['num_buckets']:>9}"
                f"{g['sync_s']:>10.4f}{g['wall_s']:>10.4f}"
                f"{g['gbps']:>8.2f}{raw}  {r['rollouts_on_version']}  direction {','.join(g.get('directions', []))}"
            )
            print(
                f"{'':<7}phases (ms): "
                + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in g.get("phase_s", {}).items())
                + f"; first sync after start {g['first_sync_s']:.3f} s"
            )
        if "vs_bfloat16" in r:
            v = r["vs_bfloat16"]
            print(f"{'':<7}fp8-block vs bfloat16 in this run: {v['time']:.3f}x the time, {v['bytes']:.3f}x the bytes")


if __name__ == "__main__":
    sys.exit(main())
