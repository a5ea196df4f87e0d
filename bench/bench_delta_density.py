"""How many bf16 values an optimizer step changes, and what a delta sync then puts on the bus.

The README's RL loop (weightsync/rl: generate -> reward -> TrainStep -> Sync, GRPO on the
target-tokens task) against a TrainerApp and a RolloutApp in this process, over TCP with
sync_encoding=delta: AdamW at each `--lrs`, fp32 master parameters exported as bf16, for `--steps`
steps, with the hf backend and the megatron-core backend (gloo, world size 1 on the CPU), on the
tiny model (`--model`). After each step's sync it records:

- changed: the fraction of the exported bf16 values whose 16 bits differ from the previous step's
- wire_ratio: that sync's bytes on the bus (SyncReport.wire_bytes, frames included) / the model's bytes,
  and the encoding the rollout got (delta after the first sync)

    OMP_NUM_THREADS=1 python -m bench delta_density
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from weightsync.local.procs import free_port  # noqa: E402


def _snapshot(actor) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.bfloat16).clone() for n, t in actor.export_tensors()}


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> tuple[int, int]:
    n = total = 0
    for k, a in after.items():
        n += int((a.view(torch.int16) != before[k].view(torch.int16)).sum())
        total += a.numel()
    return n, total


def run(backend: str, lr: float, steps: int, model: str, seed: int) -> dict:
    from rollout_svc.app import RolloutApp
    from rollout_svc.config import RolloutConfig
    from trainer_svc.app import TrainerApp
    from trainer_svc.config import TrainerConfig
    from weightsync.rl.driver import LoopConfig, run_loop
    from weightsync.rl.tasks import TargetTokensTask

    trainer = TrainerApp(
        TrainerConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            backend=backend,
            model=model,
            init_seed=seed,
            export_dtype="bfloat16",
            param_dtype="float32",
            lr=lr,
            sync_encoding="delta",
            auto_sync_new_rollouts=False,
        )
    )
    trainer.start()
    rollout = RolloutApp(
        RolloutConfig.from_flat(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            model=model,
            dtype="bfloat16",
            rollout_id="r0",
            data_address=f"127.0.0.1:{free_port()}",
        )
    )
    rollout.start()
    rows: list[dict] = []
    try:
        from weightsync.control.client import channel, trainer_stub
        from weightsync.v1 import trainer_pb2

        with channel(trainer.grpc.address) as ch:
            trainer_stub(ch, "", 120).RegisterRollout(
                trainer_pb2.RegisterRolloutRequest(rollout_id="r0", address=rollout.grpc.address)
            )
        prev = [_snapshot(trainer.actor)]

        def on_step(rec) -> None:
            now = _snapshot(trainer.actor)
            n, total = _changed(prev[0], now)
            prev[0] = now
            rep = trainer.orch.last_report
            rows.append(
                {
                    "step": rec.step,
                    "changed": n / total,
                    "values": total,
                    "encoding": rep.rollouts[0].encoding if rep.rollouts else "",
                    "bytes": rep.bytes,
                    "wire_bytes": rep.wire_bytes,
                    "wire_ratio": rep.wire_bytes / rep.bytes if rep.bytes else 0.0,
                    "sync_s": rep.seconds,
                    "reward_mean": rec.reward_mean,
                }
            )
            r = rows[-1]
            print(
                f"{backend} lr={lr:g} step {r['step']}: changed {r['changed']:.4%}  {r['encoding']} "
                f"wire {r['wire_ratio']:.4f}x  reward {r['reward_mean']:.3f}",
                flush=True,
            )

        vocab = int(trainer.actor.export_metas()[0].shape[0])
        cfg = LoopConfig(measure_mismatch=False, seed=seed)
        run_loop(trainer.grpc.address, [rollout.grpc.address], TargetTokensTask(vocab), steps, cfg, on_step=on_step)
    finally:
        rollout.stop()
        trainer.stop()
    return {"backend": backend, "lr": lr, "steps": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", nargs="+", default=["hf", "megatron"])
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", default="tiny-qwen2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)
    runs = [run(b, lr, args.steps, args.model, args.seed) for b in args.backends for lr in args.lrs]
    for r in runs:
        later = [s for s in r["steps"] if s["encoding"] == "delta"]
        r["median_changed"] = statistics.median(s["changed"] for s in r["steps"])
        r["median_wire_ratio_delta"] = statistics.median(s["wire_ratio"] for s in later) if later else None
    print(json.dumps([{k: r[k] for k in ("backend", "lr", "median_changed", "median_wire_ratio_delta")} for r in runs]))
    from bench.common.results import write_result

    machine = f"{platform.node()} {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"
    # no baseline: a count of changed values, not a time against a bound
    write_result("delta_density", runs, out=args.out or None, device="cpu", machine=machine, model=args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
