"""Full vs delta syncs over a paced TCP link, through the services, after 2 % of the values changed.

A TrainerApp (hf backend, bf16 parameters and export) and a RolloutApp (staged) run in this process
on loopback; the rollout's data port sits behind a BusProxy (tests/support/bus_proxy.py) that
paces the trainer's bus bytes to `--gbps` (the sync link passes unshaped). Each sync first changes
`--changed` of the trainer's values (as an optimizer step at a small learning rate does), then:

- full:  sync_encoding=full (every bucket dense; the trainer keeps no base)
- delta: sync_encoding=delta, after one untimed sync that gives both ends the base

alternating, `--reps` times each; the rollout's weights are checked bit-exact after the last one.
Speed-up = median full seconds / median delta seconds.

    OMP_NUM_THREADS=1 python bench/bench_delta.py --out bench/results/results_delta_cpu_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

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


def _change(model, fraction: float, g: torch.Generator) -> None:
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=g) < fraction
            p[mask] = (p[mask].float() * 1.5 + 0.01).to(p.dtype)


def _row(rep: trainer_pb2.SyncReport) -> dict:
    r = rep.rollouts[0]
    return {
        "seconds": rep.seconds,
        "stream_s": rep.phase_seconds.get("stream", 0.0),
        "encoding": r.encoding,
        "bytes": rep.bytes,
        "wire_bytes": rep.wire_bytes,
        "phase_seconds": dict(rep.phase_seconds),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gbps", type=float, default=1.0, help="link rate, Gb/s")
    ap.add_argument("--changed", type=float, default=0.02, help="fraction of values changed per sync")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--apply-mode", default="staged", choices=("staged", "inplace"), help="the rollout's apply_mode")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from transformers import Qwen2Config

    from rollout_svc.app import RolloutApp
    from rollout_svc.config import RolloutConfig
    from trainer_svc.app import TrainerApp
    from trainer_svc.config import TrainerConfig

    work = Path(tempfile.mkdtemp(prefix="bench-delta-"))
    Qwen2Config(**MODEL).save_pretrained(str(work / "model"))
    trainer = TrainerApp(
        TrainerConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            backend="hf",
            model=str(work / "model"),
            export_dtype="bfloat16",
            param_dtype="bfloat16",
            bucket_mb=args.bucket_mb,
            sync_timeout_s=300.0,
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
        _change(trainer.actor.model, args.changed, g)
        trainer.actor.version += 1
        orch.delta.encoding = encoding
        rep = stub.Sync(trainer_pb2.SyncRequest(transport="tcp")).report
        if not rep.ok:
            raise RuntimeError(f"sync ({encoding}) failed: {[r.error for r in rep.rollouts]}")
        return rep

    try:
        with channel(trainer.grpc.address) as ch:
            stub = trainer_stub(ch, "", 600)
            stub.RegisterRollout(trainer_pb2.RegisterRolloutRequest(rollout_id="r0", address=rollout.grpc.address))
            unpaced = {"full": _row(sync("full"))}
            sync("delta")  # the base
            unpaced["delta"] = _row(sync("delta"))
            links.reset(args.gbps * 1e9 / 8)
            runs: dict[str, list[dict]] = {"full": [], "delta": []}
            for _ in range(args.reps):
                runs["full"].append(_row(sync("full")))
                sync("delta")  # the base (untimed: after a full sync the trainer keeps none)
                runs["delta"].append(_row(sync("delta")))
                assert runs["delta"][-1]["encoding"] == "delta", runs["delta"][-1]
                print(f"full {runs['full'][-1]['seconds']:.3f}s  delta {runs['delta'][-1]['seconds']:.3f}s", flush=True)
        exact = all(
            torch.equal(rollout.engine._target(n), t.to(rollout.engine._target(n).dtype))
            for n, t in trainer.actor.export_tensors()
        )
        med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
        model_bytes = runs["full"][-1]["bytes"]
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.node()} {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})",
            "command": "OMP_NUM_THREADS=1 python bench/bench_delta.py " + " ".join(sys.argv[1:]),
            "model": MODEL,
            "model_mb": model_bytes / 1e6,
            "changed_fraction": args.changed,
            "gbps": args.gbps,
            "bucket_mb": args.bucket_mb,
            "apply_mode": args.apply_mode,
            "unpaced": unpaced,
            "runs": runs,
            "median_s": med,
            "wire_ratio": statistics.median(r["wire_bytes"] / r["bytes"] for r in runs["delta"]),
            "link_bound_full_s": model_bytes * 8 / (args.gbps * 1e9),
            "speedup": med["full"] / med["delta"],
            "bit_exact": exact,
            "trainer_base_mb": orch.delta.held_bytes() / 1e6,
            "rollout_base_mb": rollout.tx.delta_base.held_bytes() / 1e6,
        }
        print(json.dumps({k: result[k] for k in ("model_mb", "median_s", "wire_ratio", "speedup", "bit_exact")}))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return 0 if exact else 1
    finally:
        proxy.close()
        rollout.stop()
        trainer.stop()


if __name__ == "__main__":
    sys.exit(main())
