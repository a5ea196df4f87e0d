"""`python -m weightsync.rl`: start a trainer and rollouts on this machine and run the RL loop.

Prints a progress bar and a per-step table (reward, versions, sync time, train/inference log-prob
mismatch) and writes a PNG of reward and sync time per step. `--no-sync` is the control
experiment: the trainer trains but the rollouts never receive its weights, so reward stays at
chance. `--trainer-address/--rollout-addresses` drive already running services instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m weightsync.rl", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backend", choices=["megatron", "hf"], default="hf")
    p.add_argument("--model", default="tiny-qwen2")
    p.add_argument("--tp", type=int, default=1, help="trainer tensor-parallel size (megatron; torchrun tp*pp ranks)")
    p.add_argument("--pp", type=int, default=1, help="trainer pipeline-parallel size (megatron)")
    p.add_argument("--rollouts", type=int, default=2, help="rollout processes to start")
    p.add_argument(
        "--engine",
        choices=["builtin", "sglang"],
        default="builtin",
        help="the rollouts' engine; sglang: colocated on --device with the trainer (needs an HF model directory "
        "as --model, SGLang installed), synced over CUDA IPC, its GPU memory released for every train step",
    )
    p.add_argument("--device", default="", help="the rollouts' device (default: the rollout's own; sglang: cuda:0)")
    p.add_argument(
        "--sglang-arg", action="append", default=[], metavar="KEY=VALUE", help="an SGLang ServerArgs field (repeat)"
    )
    p.add_argument(
        "--no-release-memory",
        action="store_true",
        help="sglang: keep SGLang's memory held during the train step (the comparison run)",
    )
    p.add_argument("--task", default="target-tokens")
    p.add_argument(
        "--reward", default="", help="module:function (prompt_ids, response_ids) -> float; default: the task's"
    )
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--lr-warmup-steps", type=int, default=0)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--entropy-coef", type=float, default=0.0)
    p.add_argument("--aggregation", choices=["token-mean", "seq-mean"], default="token-mean")
    p.add_argument("--micro-batch-size", type=int, default=0)
    p.add_argument("--no-sync", action="store_true", help="control experiment: never publish weights to the rollouts")
    p.add_argument("--checkpoint-dir", default="")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="trainer resumes from --checkpoint-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: <workdir>/rl.png)")
    p.add_argument("--json", type=Path, default=None, help="also write the records as JSON here")
    p.add_argument("--trainer-address", default="", help="use a running trainer instead of starting one")
    p.add_argument("--rollout-addresses", default="", help="comma-separated running rollouts")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--require-learning",
        type=float,
        default=None,
        metavar="MARGIN",
        help="exit 1 unless the mean reward of the last fifth of the steps exceeds that of the first "
        "fifth by at least MARGIN (the main job's check that synced weights reach the rollouts)",
    )
    return p


def _start(ns, workdir: Path):
    from weightsync.local.procs import start_rollout, start_trainer, wsctl

    # training knobs reach the trainer as WS_TRAINER_* env (the trainer config's optim/checkpoint sections)
    os.environ.update(WS_TRAINER_LR=str(ns.lr), WS_TRAINER_LR_WARMUP_STEPS=str(ns.lr_warmup_steps))
    if ns.checkpoint_dir:
        os.environ["WS_TRAINER_CHECKPOINT_DIR"] = ns.checkpoint_dir
    os.environ["WS_TRAINER_RESUME"] = "true" if ns.resume else "false"
    par = ["--tp", str(ns.tp), "--pp", str(ns.pp)] if ns.tp * ns.pp > 1 else []
    # The control must never publish weights: a rollout that re-registers (heartbeat after a slow
    # step) would otherwise get a catch-up sync and learn through the back door.
    no_catch_up = ["--no-auto-sync-new-rollouts"] if ns.no_sync else []
    trainer = start_trainer(
        workdir,
        "--backend",
        ns.backend,
        "--model",
        ns.model,
        "--init-seed",
        str(ns.seed + 1),
        *par,
        *no_catch_up,
        # SGLang serves bf16 here: the trainer trains and exports bf16, so the bus carries what SGLang holds
        *(
            ["--transport", "ipc", "--param-dtype", "bfloat16", "--export-dtype", "bfloat16"]
            if ns.engine == "sglang"
            else []
        ),
        nproc=ns.tp * ns.pp,
    )
    procs = [trainer]
    trainer.wait_ready(300)
    procs += [
        start_rollout(
            workdir,
            "--model",
            ns.model,
            "--init-seed",
            str(100 + i),
            "--trainer-address",
            trainer.address,
            *_engine_args(ns),
            name=f"rollout-{i}",
        )
        for i in range(ns.rollouts)
    ]
    for r in procs[1:]:
        r.wait_ready(300)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # registration (and catch-up sync to the trainer's version)
        out = wsctl("--address", trainer.address, "--json", "status")
        st = json.loads(out.stdout) if out.returncode == 0 else {}
        if len(st.get("rollouts", [])) == ns.rollouts:
            if ns.no_sync or all(int(r["version"]) == int(st["version"]) for r in st["rollouts"]):
                break
        time.sleep(0.3)
    else:
        raise RuntimeError(f"rollouts did not register with the trainer in time; logs in {workdir}")
    return trainer, procs


def _engine_args(ns) -> list[str]:
    """The rollouts' engine options: SGLang colocated with the trainer, its memory releasable (enable_memory_saver),
    applied in place (the weights are mapped again before a sync's first bucket)."""
    out = ["--device", ns.device] if ns.device else []
    if ns.engine == "builtin":
        return out
    out = ["--device", ns.device or "cuda:0", "--engine", "sglang", "--apply-mode", "inplace", "--dtype", "bfloat16"]
    args = ["enable_memory_saver=true", *ns.sglang_arg]
    return out + [a for kv in args for a in ("--sglang-arg", kv)]


def _summarize(ns, records, task, workdir: Path, wall: float) -> int:
    """Plot, JSON, the reward summary and, with --require-learning, the verdict (the exit code)."""
    from weightsync.rl.report import plot

    png = plot(
        records,
        ns.plot or workdir / "rl.png",
        f"{task.name} ({ns.backend}, {ns.model}, sync {'off' if ns.no_sync else 'on'})",
    )
    if ns.json:
        ns.json.write_text(json.dumps([r.as_dict() for r in records], indent=1))
    k = max(1, len(records) // 5)
    first = sum(r.reward_mean for r in records[:k]) / k
    last = sum(r.reward_mean for r in records[-k:]) / k
    print(
        f"reward: first {k} steps {first:.3f} → last {k} steps {last:.3f} (chance {task.chance_reward:.3f}); "
        f"{len(records)} steps in {wall:.1f}s; plot {png}"
    )
    if ns.require_learning is None:
        return 0
    if last - first >= ns.require_learning:
        print(f"PASS: reward rose by {last - first:.3f} (required {ns.require_learning:.3f})")
        return 0
    print(
        f"FAIL: reward rose by {last - first:.3f}, less than the required {ns.require_learning:.3f}; logs in {workdir}"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    from weightsync.models import resolve_model
    from weightsync.rl.driver import LoopConfig, run_loop
    from weightsync.rl.report import HEADER, row
    from weightsync.rl.reward import load_reward
    from weightsync.rl.tasks import make_task

    workdir = (ns.workdir or Path(tempfile.mkdtemp(prefix="weightsync-rl-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if ns.checkpoint_dir:
        # absolute: the trainer takes a relative SaveCheckpoint path from its data root, not our cwd
        ns.checkpoint_dir = str(Path(ns.checkpoint_dir).resolve())
    vocab = int(resolve_model(ns.model)[0].vocab_size)
    task = make_task(ns.task, vocab)
    reward_fn = load_reward(ns.reward) if ns.reward else None
    cfg = LoopConfig(
        prompts_per_step=ns.prompts_per_step,
        group_size=ns.group_size,
        max_new_tokens=ns.max_new_tokens,
        aggregation=ns.aggregation,
        kl_coef=ns.kl_coef,
        entropy_coef=ns.entropy_coef,
        micro_batch_size=ns.micro_batch_size,
        sync=not ns.no_sync,
        seed=ns.seed,
        release_memory=ns.engine == "sglang" and not ns.no_release_memory,
        checkpoint_every=ns.checkpoint_every,
        checkpoint_dir=ns.checkpoint_dir,
    )
    procs = []
    try:
        if ns.trainer_address:
            trainer_addr = ns.trainer_address
            rollout_addrs = [a for a in ns.rollout_addresses.split(",") if a]
        else:
            t0 = time.perf_counter()
            trainer, procs = _start(ns, workdir)
            trainer_addr, rollout_addrs = trainer.address, [p.address for p in procs[1:]]
            print(
                f"started trainer ({ns.backend} TP={ns.tp} PP={ns.pp}, {ns.model}) and {ns.rollouts} rollout(s) in "
                f"{time.perf_counter() - t0:.1f}s; logs in {workdir}"
            )
        print(
            f"task {task.name}: chance reward {task.chance_reward:.3f}; sync {'off (control)' if ns.no_sync else 'on'}"
        )
        from tqdm import tqdm

        bar = tqdm(total=ns.steps, desc="rl", unit="step", disable=ns.quiet, dynamic_ncols=True)
        bar.write(HEADER)

        def on_step(r):
            bar.write(row(r))
            bar.set_postfix(reward=f"{r.reward_mean:.3f}", v=r.trainer_version)
            bar.update(1)

        t0 = time.perf_counter()
        records = run_loop(trainer_addr, rollout_addrs, task, ns.steps, cfg, reward_fn, on_step)
        bar.close()
        return _summarize(ns, records, task, workdir, time.perf_counter() - t0)
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    sys.exit(main())
