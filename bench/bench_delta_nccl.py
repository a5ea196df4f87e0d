"""Full vs delta syncs over NCCL between two GPUs, through the services (the codec alone: `delta_codec`).

A TrainerApp (hf, bf16, on cuda:0) and a RolloutApp (built-in engine, on cuda:1) in
this process, transport nccl (libnccl), `--shape` of bench/common/models.py's MODELS. Each timed sync first
changes `--density` of the trainer's values, then, alternating `--reps` times: a full sync
(sync_encoding=full) and a delta sync (sync_encoding=delta, forced: both GPUs are on one host, where
auto picks full; after two untimed syncs that give both ends the base). Bit-exact after the last.
Run it once as is (NVLink / P2P) and once with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (NCCL's socket
transport over loopback: a stand-in for a link between hosts, which this machine does not have).
Each full row carries `link_GBps`: the link's rate as that sync measured it (publisher/delta_sync.py).

`--auto N`: instead, N syncs under sync_encoding=auto (`--delta-link-gbps`, default the trainer's 400)
after the untimed first: per sync its encoding, time, wire ratio, the measured rate and whether the
trainer then holds a base. Over NVLink every one should stay full with no base; over the socket
transport the third after the first measured one should be a delta:

    python -m bench delta_nccl --shape 1.5b --bucket-mb 1024 --auto 6
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 python -m bench delta_nccl --shape 1.5b --bucket-mb 1024 --auto 6

    python -m bench delta_nccl --shape 1.5b --reps 3

The 1.5B shape's setup (both models built in this process) took over 60 s on an H100 host: give a run
several minutes. The script itself runs on CPU over the gloo stand-in (a check, not a measurement):
    python -m bench delta_nccl --shape "" --trainer-device cpu --rollout-device cpu --reps 1 \
        --nccl-bus tests.support.gloo_nccl:GlooNcclBus
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.common.models import qwen2_kwargs, row_of  # noqa: E402
from bench.common.results import write_result  # noqa: E402
from bench.common.syncs import change_values, sync_row  # noqa: E402


def services(args) -> dict:
    from transformers import Qwen2Config

    from bench.bench_delta import MODEL
    from rollout_svc.app import RolloutApp
    from rollout_svc.config import RolloutConfig
    from trainer_svc.app import TrainerApp
    from trainer_svc.config import TrainerConfig
    from weightsync.control.client import channel, trainer_stub
    from weightsync.v1 import trainer_pb2

    model = {**qwen2_kwargs(row_of(args.shape), args.layers), "max_position_embeddings": 512} if args.shape else MODEL
    work = Path(tempfile.mkdtemp(prefix="bench-delta-nccl-"))
    Qwen2Config(**model).save_pretrained(str(work / "model"))
    t0 = time.perf_counter()
    trainer = TrainerApp(
        TrainerConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            backend="hf",
            model=str(work / "model"),
            device=args.trainer_device,
            export_dtype="bfloat16",
            param_dtype="bfloat16",
            bucket_mb=args.bucket_mb,
            sync_timeout_s=600.0,
            auto_sync_new_rollouts=False,
            sync_encoding="delta",
            transport="nccl",
            liveness_timeout_s=60.0,
            nccl_bus=args.nccl_bus,
        )
    )
    trainer.start()
    rollout = RolloutApp(
        RolloutConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            model=str(work / "model"),
            dtype="bfloat16",
            device=args.rollout_device,
            rollout_id="r0",
            apply_mode=args.apply_mode,
            nccl_bus=args.nccl_bus,
        )
    )
    rollout.start()
    g = torch.Generator().manual_seed(0)

    if args.delta_link_gbps is not None:
        trainer.orch.delta.link_gbps = args.delta_link_gbps

    def sync(encoding: str) -> trainer_pb2.SyncReport:
        change_values(trainer.actor.model, args.density, g)
        trainer.actor.version += 1
        trainer.orch.delta.encoding = encoding
        rep = stub.Sync(trainer_pb2.SyncRequest(transport="nccl")).report
        if not rep.ok:
            raise RuntimeError(f"sync ({encoding}) failed: {[r.error for r in rep.rollouts]}")
        return rep

    def exact() -> bool:
        return all(
            torch.equal(rollout.engine._target(n).cpu(), t.to(rollout.engine._target(n).dtype).cpu())
            for n, t in trainer.actor.export_tensors()
        )

    def row(rep: trainer_pb2.SyncReport) -> dict:
        rate = trainer.orch.delta.link_rate
        return {**sync_row(rep), "link_GBps": rate / 1e9 if rate else None, "base_held": bool(trainer.orch.delta.held)}

    try:
        with channel(trainer.grpc.address) as ch:
            stub = trainer_stub(ch, "", 600)
            stub.RegisterRollout(trainer_pb2.RegisterRolloutRequest(rollout_id="r0", address=rollout.grpc.address))
            setup_s = time.perf_counter() - t0
            sync("full")  # the group's build and the first touches, untimed
            if args.auto:
                runs = [row(sync("auto")) for _ in range(args.auto)]
                return {**auto(args, model, setup_s, runs), "bit_exact": exact()}
            runs: dict[str, list[dict]] = {"full": [], "delta": []}
            for _ in range(args.reps):
                runs["full"].append(row(sync("full")))
                sync("delta")  # kept by the trainer, not offered yet
                sync("delta")  # offered, refused (no copy on the rollout), framed dense: kept by the rollout
                runs["delta"].append(sync_row(sync("delta")))
                assert runs["delta"][-1]["encoding"] == "delta", runs["delta"][-1]
                print(
                    f"nccl: full {runs['full'][-1]['seconds']:.3f}s  delta {runs['delta'][-1]['seconds']:.3f}s "
                    f"(wire {runs['delta'][-1]['wire_bytes'] / runs['delta'][-1]['bytes']:.3f}x)",
                    flush=True,
                )
        med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
        return {
            "shape": args.shape or "small",
            "model": model,
            "model_mb": runs["full"][-1]["bytes"] / 1e6,
            "changed_fraction": args.density,
            "bucket_mb": args.bucket_mb,
            "apply_mode": args.apply_mode,
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            "setup_s": setup_s,
            "runs": runs,
            "median_s": med,
            "speedup": med["full"] / med["delta"],
            "bit_exact": exact(),
        }
    finally:
        rollout.stop()
        trainer.stop()


def auto(args, model: dict, setup_s: float, runs: list[dict]) -> dict:
    """The --auto result: what sync_encoding=auto chose, sync by sync, and the rates it measured."""
    for i, r in enumerate(runs):
        rate = f"{r['link_GBps']:.1f} GB/s" if r["link_GBps"] else "none"
        print(
            f"auto {i + 1}: {r['encoding']} {r['seconds']:.3f}s wire {r['wire_bytes'] / r['bytes']:.3f}x, "
            f"link {rate}, base {'held' if r['base_held'] else 'none'}",
            flush=True,
        )
    return {
        "shape": args.shape or "small",
        "model": model,
        "model_mb": runs[-1]["bytes"] / 1e6 if runs else 0,
        "changed_fraction": args.density,
        "bucket_mb": args.bucket_mb,
        "apply_mode": args.apply_mode,
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "delta_link_gbps": args.delta_link_gbps,
        "setup_s": setup_s,
        "auto_runs": runs,
        "encodings": [r["encoding"] for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--shape", default="1.5b")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--apply-mode", default="inplace", choices=("staged", "inplace"))
    ap.add_argument("--trainer-device", default="cuda:0")
    ap.add_argument("--rollout-device", default="cuda:1")
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    ap.add_argument("--auto", type=int, default=0, help="N syncs under sync_encoding=auto instead of full vs delta")
    ap.add_argument("--delta-link-gbps", type=float, default=None, help="--auto: the trainer's delta_link_gbps")
    ap.add_argument("--nccl-bus", default="", help="module:attr of a stand-in NCCL bus (the CPU check); empty: libnccl")
    args = ap.parse_args(argv)
    result = services(args)
    keys = ("median_s", "speedup", "bit_exact", "encodings")
    print(json.dumps({k: result[k] for k in keys if k in result}))
    if args.auto:
        rows, baseline = result.pop("auto_runs"), None
    else:
        med = result.pop("median_s")
        rows = [{"full_s": med["full"], "delta_s": med["delta"], "speedup": result.pop("speedup")}]
        baseline = {"what": "full syncs alternating with the delta syncs in the same services", "rows_key": "full_s"}
    write_result("delta_nccl", rows, baseline=baseline, out=args.out or None, **result)
    return 0 if result.get("bit_exact", True) else 1


if __name__ == "__main__":
    sys.exit(main())
