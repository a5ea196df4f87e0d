"""Colocated RL on one GPU with SGLang (issue 47 item 3): `bench/sglang_live.py --colocated-rl`.

A megatron trainer (bf16) and one SGLang rollout (`enable_memory_saver`, in-place apply) on cuda:0 run the RL
loop of `python -m weightsync.rl` (weightsync/rl/driver.py) on the demo's task (target tokens: reward = the
share of sampled tokens divisible by 8, chance 0.125) with bench/peaked_model.py's small Qwen2 shape, from
random weights, synced over CUDA IPC (SGLang's workers read the trainer's buckets: torch_memory_saver's
allocations cannot be exported, so the trainer never maps SGLang's parameters). Two phases on the same services:
  1. `--rl-steps` steps colocated: after generating, the rollout releases SGLang's weights and KV cache
     (ReleaseMemory), the trainer steps, and the sync maps the weights before its first bucket and the KV
     cache at commit;
  2. `--rl-held-steps` steps with SGLang's memory held during the train step, for the comparison.
During every train step a thread samples the GPU's device-wide used memory (`torch.cuda.mem_get_info`: the
trainer's and SGLang's processes both count), so `peak_gib_released` and `peak_gib_held` compare the two.
At the end SGLang's greedy tokens are compared with transformers' on the trainer's exported weights: the
weights SGLang serves after every release and resume are the trainer's, byte for byte, or the tokens differ.
Writes `colocated_rl: {first_reward, last_reward, syncs_exact, peak_gib_released, peak_gib_held, steps, model, ...}`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import threading
import time
import traceback
from pathlib import Path

import torch

GIB = 1 << 30
#: the colocated rollout's SGLang options beside bench/sglang_live.py's SGLANG_ARGS
COLOCATED_ARGS = {"enable_memory_saver": "true"}


class TrainPeak:
    """Samples the GPU's used memory (all processes) every `period_s` while a train step runs; per phase, the
    peak of each step."""

    def __init__(self, device: int = 0, period_s: float = 0.001):
        self.device, self.period_s = device, period_s
        self.peaks: dict[str, list[float]] = {}

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def around(self, phase: str):
        """A context manager factory for run_loop's `around_train`."""

        @contextlib.contextmanager
        def sampling():
            peak, stop = [self.used()], threading.Event()

            def run():
                while not stop.wait(self.period_s):
                    peak[0] = max(peak[0], self.used())

            th = threading.Thread(target=run, name="train-peak", daemon=True)
            th.start()
            try:
                yield
            finally:
                stop.set()
                th.join(5)
                peak[0] = max(peak[0], self.used())
                self.peaks.setdefault(phase, []).append(peak[0] / GIB)

        return sampling


def _start(work: Path, cfg_dir: Path, start_dir: Path, sglang_args: dict, ready_timeout: float):
    from weightsync.local.procs import start_rollout, start_trainer, wait_registered

    trainer = start_trainer(
        work, "--backend", "megatron", "--model", str(cfg_dir), "--init-seed", "1", "--param-dtype", "bfloat16",
        "--transport", "ipc", "--export-dtype", "bfloat16", name="rl-trainer",
    )  # fmt: skip
    procs = [trainer]
    args = ["--engine", "sglang", "--model", str(start_dir), "--device", "cuda:0", "--dtype", "bfloat16"]
    args += [
        "--apply-mode",
        "inplace",
        "--trainer-address",
        trainer.address,
        "--register-timeout-s",
        str(ready_timeout),
    ]
    args += [a for k, v in {**sglang_args, **COLOCATED_ARGS}.items() for a in ("--sglang-arg", f"{k}={v}")]
    procs.append(start_rollout(work, *args, name="rl-s0"))
    deadline = time.monotonic() + ready_timeout
    for p in procs:
        p.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
    wait_registered(trainer.address, ["rl-s0"], max(1.0, deadline - time.monotonic()))
    return procs


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _phase(rec: dict, name: str, records) -> None:
    rec[f"{name}_rewards"] = [round(r.reward_mean, 4) for r in records]
    rec[f"{name}_sync_s"] = [round(r.sync_seconds, 5) for r in records]
    rec[f"{name}_release_s"] = [round(r.release_seconds, 5) for r in records]
    rec[f"{name}_train_s"] = [round(r.train_seconds, 4) for r in records]


def _greedy_check(rec: dict, trainer_address: str, stub, work: Path, prompts) -> None:
    """SGLang's greedy tokens against transformers' on the trainer's exported weights."""
    from bench.sglang_fleet import ws
    from bench.sglang_greedy import generate, hf_reference

    after, served = generate(stub, prompts)
    export_dir = work / "rl-export"
    ws(trainer_address, "export", str(export_dir), timeout=300)
    ref = hf_reference(str(export_dir), prompts, after)
    rec["greedy_match"] = all(ref["match"])
    rec["greedy_match_up_to_ties"] = all(ref["match_up_to_ties"])
    rec["max_abs_logprob_diff"] = ref["max_abs_logprob_diff"]
    rec["served_version"] = served


def colocated_rl(res: dict, work: Path, save, steps: int, held_steps: int, ready_timeout: float) -> None:
    """Fills `res["colocated_rl"]` as it goes; `save()` writes `res` (a run cut off keeps what it measured)."""
    from bench import peaked_model
    from bench.sglang_fleet import SGLANG_ARGS, save_random_hf
    from weightsync.control.client import channel, rollout_stub
    from weightsync.rl.driver import LoopConfig, run_loop
    from weightsync.rl.tasks import make_task
    from weightsync.v1 import rollout_pb2

    lr = os.environ.setdefault("WS_TRAINER_LR", "1e-2")  # the CPU demo's (tests/e2e/test_rl_loop.py)
    rec: dict = {"model": f"peaked shape {peaked_model.SHAPE}, vocab {peaked_model.VOCAB}, random init", "lr": lr}
    rec |= {"task": "target-tokens", "steps": steps, "held_steps": held_steps, "trainer_backend": "megatron"}
    res["colocated_rl"] = rec
    procs = []
    try:
        cfg_dir = work / "rl-cfg"
        peaked_model.config().save_pretrained(str(cfg_dir))
        start_dir = save_random_hf(cfg_dir, work / "rl-start", seed=2)
        procs = _start(work, cfg_dir, start_dir, SGLANG_ARGS, ready_timeout)
        trainer, rollout = procs
        rec["idle_used_gib"] = TrainPeak().used() / GIB  # both services up, SGLang holding its memory
        task = make_task("target-tokens", peaked_model.VOCAB)
        peak = TrainPeak()
        loop = dict(prompts_per_step=8, group_size=8, max_new_tokens=8)

        def on_step(r):
            rec.setdefault("rewards_so_far", []).append(round(r.reward_mean, 4))
            save()

        def phase(name: str, n_steps: int, release: bool, seed: int) -> list:
            """Run `n_steps` RL steps with the rollout's memory released (or held) around each train step."""
            results = run_loop(
                trainer.address, [rollout.address], task, n_steps,
                LoopConfig(**loop, release_memory=release, seed=seed),
                on_step=on_step, around_train=peak.around(name),
            )  # fmt: skip
            _phase(rec, name, results)
            rec[f"peak_gib_{name}"] = max(peak.peaks[name])
            save()
            return results

        released = phase("released", steps, release=True, seed=0)
        held = phase("held", held_steps, release=False, seed=1)
        rec["peaks_gib"] = {k: [round(x, 3) for x in v] for k, v in peak.peaks.items()}
        every = released + held
        k = max(1, steps // 5)
        rec["first_reward"] = _mean([r.reward_mean for r in released[:k]])
        rec["last_reward"] = _mean([r.reward_mean for r in every[-k:]])
        rec["chance_reward"] = task.chance_reward
        # every sync committed with its checksums verified (the driver raises on one that did not)
        stub = rollout_stub(channel(rollout.address), "", 120)
        st = stub.GetStatus(rollout_pb2.GetStatusRequest())
        rec["syncs_exact"] = all(r.sync_ok for r in every) and st.version == every[-1].synced_version
        rec["rollout_memory_released_after"] = st.memory_released
        rec["median_sync_s_released"] = statistics.median(rec["released_sync_s"])
        rec["median_sync_s_held"] = statistics.median(rec["held_sync_s"])
        save()
        _greedy_check(rec, trainer.address, stub, work, peaked_model.PROMPTS)
    except BaseException as exc:  # noqa: BLE001 — SystemExit from SIGTERM too: recorded, the services stopped
        traceback.print_exc()
        rec["error"] = repr(exc)[:3000]
    finally:
        for p in procs:
            rec.setdefault("logs_tail", {})[p.name] = p.log()[-3000:]
            logs = Path(os.environ.get("OUT", "/tmp")) / "logs"
            logs.mkdir(exist_ok=True)
            (logs / f"{p.name}.log").write_text(p.log())
            p.stop()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.popen.pid, signal.SIGKILL)  # SGLang's scheduler children too
        save()
