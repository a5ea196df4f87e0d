"""Full vs delta syncs over a paced TCP link, through the services, after 2 % of the values changed.

A TrainerApp (hf backend, bf16 parameters and export) and a RolloutApp (staged) run in this process
on loopback; the rollout's data port sits behind a BusProxy (tests/support/bus_proxy.py) that
paces the trainer's bus bytes to each of `--gbps` (the sync link passes unshaped). Each sync first
changes `--density` of the trainer's values (as an optimizer step at a small learning rate does), then:

- full:  sync_encoding=full (every bucket dense; the trainer keeps no base)
- delta: sync_encoding=delta, after one untimed sync that gives both ends the base

alternating, `--reps` times each per rate; the rollout's weights are checked bit-exact after the last one.
Speed-up = median full seconds / median delta seconds.

The model: a small Qwen2 shape (82 MB in bf16) by default, or `--shape` one of bench/common/models.py's MODELS
(1.5b: Qwen2.5-1.5B, 3.09 GB in bf16; `--layers` cuts its depth to fit the host's memory: this
process holds the trainer's parameters and base copy and the rollout's, about 4-5x the export).

    OMP_NUM_THREADS=1 python -m bench delta
    OMP_NUM_THREADS=1 python -m bench delta --shape 1.5b --density 0.02 --gbps 1 10 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
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
from tests.support.bus_proxy import BusProxy, SenderLinks  # noqa: E402  (the test proxy: run from a checkout)
from weightsync.control.client import channel, trainer_stub  # noqa: E402
from weightsync.local.procs import free_port  # noqa: E402
from weightsync.v1 import trainer_pb2  # noqa: E402

# a small Qwen2 shape (about 41M parameters, 82 MB in bf16)
MODEL = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=16384,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gbps", type=float, nargs="+", default=[1.0], help="link rates, Gb/s (each in turn)")
    ap.add_argument("--density", "--changed", type=float, default=0.02, help="fraction of values changed per sync")
    ap.add_argument(
        "--shape", default="", help="a MODELS shape (bench/common/models.py): 0.5b, 1.5b, 7b; default: 82 MB"
    )
    ap.add_argument("--layers", type=int, default=0, help="with --shape: this many layers instead of the model's")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--apply-mode", default="staged", choices=("staged", "inplace"), help="the rollout's apply_mode")
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)
    from transformers import Qwen2Config

    from rollout_svc.app import RolloutApp
    from rollout_svc.config import RolloutConfig
    from trainer_svc.app import TrainerApp
    from trainer_svc.config import TrainerConfig

    model = {**qwen2_kwargs(row_of(args.shape), args.layers), "max_position_embeddings": 512} if args.shape else MODEL
    work = Path(tempfile.mkdtemp(prefix="bench-delta-"))
    Qwen2Config(**model).save_pretrained(str(work / "model"))
    t_setup = time.perf_counter()
    trainer = TrainerApp(
        TrainerConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            backend="hf",
            model=str(work / "model"),
            export_dtype="bfloat16",
            param_dtype="bfloat16",
            bucket_mb=args.bucket_mb,
            sync_timeout_s=900.0,
            auto_sync_new_rollouts=False,
            sync_encoding="delta",
        )
    )
    trainer.start()
    dport = free_port()
    links = SenderLinks(None)
    proxy = BusProxy("127.0.0.2", dport, ("127.0.0.1", dport), links)
    rollout = RolloutApp(
        RolloutConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            model=str(work / "model"),
            dtype="bfloat16",
            rollout_id="r0",
            apply_mode=args.apply_mode,
            data_address=f"127.0.0.1:{dport}",
            advertise_data_host="127.0.0.2",
        )
    )
    rollout.start()
    g = torch.Generator().manual_seed(0)
    orch = trainer.orch

    def sync(encoding: str) -> trainer_pb2.SyncReport:
        change_values(trainer.actor.model, args.density, g)
        trainer.actor.version += 1
        orch.delta.encoding = encoding
        rep = stub.Sync(trainer_pb2.SyncRequest(transport="tcp")).report
        if not rep.ok:
            raise RuntimeError(f"sync ({encoding}) failed: {[r.error for r in rep.rollouts]}")
        return rep

    try:
        with channel(trainer.grpc.address) as ch:
            stub = trainer_stub(ch, "", 900)
            stub.RegisterRollout(trainer_pb2.RegisterRolloutRequest(rollout_id="r0", address=rollout.grpc.address))
            setup_s = time.perf_counter() - t_setup
            unpaced = {"full": sync_row(sync("full"))}
            sync("delta")  # the base
            unpaced["delta"] = sync_row(sync("delta"))
            print(
                f"unpaced: full {unpaced['full']['seconds']:.3f}s  delta {unpaced['delta']['seconds']:.3f}s", flush=True
            )
            rates = {}
            for gbps in args.gbps:
                links.reset(gbps * 1e9 / 8)
                runs: dict[str, list[dict]] = {"full": [], "delta": []}
                for _ in range(args.reps):
                    runs["full"].append(sync_row(sync("full")))
                    sync("delta")  # the base (untimed: after a full sync the trainer keeps none)
                    runs["delta"].append(sync_row(sync("delta")))
                    assert runs["delta"][-1]["encoding"] == "delta", runs["delta"][-1]
                    print(
                        f"{gbps:g} Gb/s: full {runs['full'][-1]['seconds']:.3f}s  "
                        f"delta {runs['delta'][-1]['seconds']:.3f}s",
                        flush=True,
                    )
                med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
                model_bytes = runs["full"][-1]["bytes"]
                rates[f"{gbps:g}"] = {
                    "gbps": gbps,
                    "runs": runs,
                    "median_s": med,
                    "wire_ratio": statistics.median(r["wire_bytes"] / r["bytes"] for r in runs["delta"]),
                    "link_bound_full_s": model_bytes * 8 / (gbps * 1e9),
                    "speedup": med["full"] / med["delta"],
                }
        exact = all(
            torch.equal(rollout.engine._target(n), t.to(rollout.engine._target(n).dtype))
            for n, t in trainer.actor.export_tensors()
        )
        model_bytes = unpaced["full"]["bytes"]
        result = {
            "machine": f"{platform.node()} {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})",
            "shape": args.shape or "small",
            "model": model,
            "model_mb": model_bytes / 1e6,
            "changed_fraction": args.density,
            "bucket_mb": args.bucket_mb,
            "apply_mode": args.apply_mode,
            "setup_s": setup_s,
            "unpaced": unpaced,
            "bit_exact": exact,
            "trainer_base_mb": orch.delta.held_bytes() / 1e6,
            "rollout_base_mb": rollout.tx.delta_base.held_bytes() / 1e6,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
        }
        summary = {k: {x: r[x] for x in ("median_s", "wire_ratio", "speedup")} for k, r in rates.items()}
        print(json.dumps({"model_mb": result["model_mb"], "bit_exact": exact, "rates": summary}))
        rows = [
            {"gbps": r["gbps"], "full_s": r["median_s"]["full"], "delta_s": r["median_s"]["delta"], **r}
            for r in rates.values()
        ]
        baseline = {"what": "full syncs alternating with the delta syncs, same services and link", "rows_key": "full_s"}
        write_result("delta", rows, baseline=baseline, out=args.out or None, device="cpu", **result)
        return 0 if exact else 1
    finally:
        proxy.close()
        rollout.stop()
        trainer.stop()


if __name__ == "__main__":
    sys.exit(main())
