"""SGLang's real Engine on a GPU behind `rollout-svc --engine sglang`, synced from a megatron-core trainer
through the services and `wsctl` (issue 34). Run by bench/sglang_live.sh on a GPU host; needs SGLang
importable (its wheel and light deps) and, where sgl_kernel is absent, the harness shim
(tests/support/sgl_kernel_shim.py, installed by sitecustomize in every process).

One trainer (megatron, bf16) on cuda:0, one SGLang rollout `s0` and one built-in-engine rollout `b0` on
the same GPU; with two GPUs visible also `s1` (SGLang) and `b1` (built-in) on cuda:1 for NCCL. The
trainer's weights: `--peaked DIR` (bench/peaked_model.py's checkpoints `a` and `b`: a small Qwen2 trained
to decisive next-token margins, so greedy tokens can be compared strictly) or random weights of `--model`'s
shape. Per transport (ipc -> s0, tcp -> s0, nccl -> s1):
  1. the trainer gets new weights (`wsctl load`: peaked `b` for tcp, `a` for nccl, or fresh random ones;
     the ipc run syncs the trainer's initial weights),
  2. the SGLang rollout generates the fixed prompts twice on its OLD weights (the second must hit the radix
     cache),
  3. `wsctl sync --rollout sX --transport T` (+ --reps timed re-syncs), then the built-in rollout likewise,
  4. it generates again: greedy tokens vs transformers (bf16, cuda) on `wsctl export`'s directory,
     max |log-prob| difference on SGLang's tokens, prefix_cache_hit on the first request after the
     sync (must be False: the radix cache was flushed), served version == the trainer's.
`--bucket-mb N` (default 1): the trainer's bucket size for these runs, so even the peaked model (~5 MB)
syncs in several buckets (`num_buckets` in each run).
`--timing-model 1.5b,7b` then restarts the services at each shape (random weights, the trainer's default
bucket size) and times the sync into SGLang beside the built-in engine over `--timing-transports`.
`--timing-dtype fp8-block`: those runs export block FP8 (the trainer's fp8-block), SGLang serving a block-FP8
checkpoint of the same random weights (`save_random_fp8`) and the built-in engine the bf16 one.
`--tp-size N`: SGLang's tp_size (every SGLang rollout; its ranks on GPUs 0..N-1 for ipc and tcp, beside the
trainer on cuda:0; nccl: rollout_layout), each run recording `tp_size` and the SGLang rollout's `bytes_per_rank`.
`--concurrency N` (before the services stop): N clients each send one greedy Generate of one prompt at
once, against the same N calls one after another, on the SGLang rollout and on the built-in one: the
tokens/s of each and their ratio (SGLang batches concurrent requests itself; the built-in engine
interleaves them step by step), and whether the concurrent answers equal the sequential ones.
Writes the house schema's JSON (bench/sglang_results.py: rows = the timing runs and token checks, baseline =
the built-in engine in the same run) with `runs[]`, `timing_runs[]`, `colocated_rl` and details, as it goes.
Modules: bench/sglang_fleet.py (the services), sglang_greedy.py (the token check), sglang_timing.py (the
timed shapes), sglang_concurrency.py, sglang_rl.py (the colocated RL run), sglang_results.py (the file).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("WS_LOCAL_OMP_THREADS", "8")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

import torch  # noqa: E402

from bench import peaked_model, sglang_results  # noqa: E402
from bench.common.models import write_config  # noqa: E402
from bench.sglang_concurrency import concurrency_run, print_concurrency  # noqa: E402
from bench.sglang_fleet import SGLANG_ARGS, Fleet, rollout_layout, save_random_hf  # noqa: E402
from bench.sglang_greedy import N_NEW, RANDOM_PROMPTS, greedy_runs, print_runs  # noqa: E402
from bench.sglang_timing import print_timing, timing_runs  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="0.5b", help="shape of the random weights when --peaked is not given")
    ap.add_argument("--peaked", default="", help="bench/peaked_model.py's output dir (checkpoints a and b)")
    ap.add_argument("--transports", default="", help="default: ipc,tcp, and nccl when 2 GPUs are visible")
    ap.add_argument(
        "--reps",
        type=int,
        default=5,
        help="timed syncs per transport and engine (greedy runs: after one warm-up; --timing-model runs: after two)",
    )
    ap.add_argument("--bucket-mb", type=int, default=1, help="the trainer's bucket size (MiB) in the token checks")
    ap.add_argument("--timing-model", default="", help="then time syncs at these shapes (1.5b,7b), random weights")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ready-timeout", type=float, default=240)
    ap.add_argument("--concurrency", type=int, default=0, help="N concurrent one-prompt requests vs sequential")
    ap.add_argument("--concurrency-tokens", type=int, default=64, help="new tokens per concurrent request")
    ap.add_argument("--colocated-rl", action="store_true", help="only the colocated RL run (bench/sglang_rl.py)")
    ap.add_argument("--rl-steps", type=int, default=14, help="colocated RL steps with SGLang's memory released")
    ap.add_argument("--rl-held-steps", type=int, default=4, help="then steps with it held, for the comparison")
    ap.add_argument("--timing-transports", default="ipc", help="transports of the --timing-model runs (ipc,nccl)")
    ap.add_argument("--timing-only", action="store_true", help="only the --timing-model runs (no greedy runs)")
    ap.add_argument("--tp-size", type=int, default=1, help="SGLang's tp_size (its ranks on GPUs 0..N-1; nccl: below)")
    ap.add_argument(
        "--timing-dtype",
        default="bfloat16",
        choices=("bfloat16", "fp8-block"),
        help="the trainer's export dtype in the --timing-model runs; fp8-block: SGLang serves a block-FP8 checkpoint",
    )
    args = ap.parse_args(argv)
    if args.timing_only and not args.timing_model:
        raise SystemExit("--timing-only needs --timing-model")
    return args


def check_gpus(args, transports: list[str], timing_transports: list[str], gpus: int) -> None:
    if "nccl" in transports and gpus < 2:
        raise SystemExit("transport nccl needs 2 visible GPUs (trainer on cuda:0, rollouts on cuda:1)")
    if "nccl" in timing_transports and args.timing_model and gpus < 2:
        raise SystemExit("--timing-transports nccl needs 2 visible GPUs")
    if args.tp_size > gpus:
        raise SystemExit(f"--tp-size {args.tp_size} needs as many visible GPUs ({gpus} here)")


def new_result(args, gpus: int, prompts) -> dict:
    import sglang.version

    peaked = Path(args.peaked) if args.peaked else None
    res: dict = {
        "date": sglang_results.now(),
        "gpus": gpus,
        "engine_version": sglang.version.__version__,
        "torch": torch.__version__,
        "model": f"peaked ({peaked_model.SHAPE}, vocab {peaked_model.VOCAB})" if peaked else args.model,
        "weights": "trained (bench/peaked_model.py)" if peaked else "random",
        "prompts": prompts,
        "max_new_tokens": N_NEW,
        "sglang_args": SGLANG_ARGS,
        "tp_size": args.tp_size,
        "bucket_mb": args.bucket_mb,
        "timing_models": [m for m in args.timing_model.split(",") if m],
        "runs": [],
    }
    if peaked:
        res["peaked_report"] = json.loads((peaked / "peaked_report.json").read_text())
    return res


def run_rl(res: dict, work: Path, args, save) -> int:
    """The colocated RL run alone: it fits one device call (bench/sglang_rl.py)."""
    from bench.sglang_rl import colocated_rl

    colocated_rl(res, work, save, args.rl_steps, args.rl_held_steps, args.ready_timeout)
    rl = res["colocated_rl"]
    print({k: rl.get(k) for k in ("first_reward", "last_reward", "syncs_exact", "peak_gib_released")}, flush=True)
    print({k: rl.get(k) for k in ("peak_gib_held", "greedy_match", "greedy_match_up_to_ties", "error")}, flush=True)
    return 0 if rl.get("syncs_exact") and "error" not in rl else 1


def token_checks(res: dict, work: Path, args, transports: list[str], gpus: int, prompts, save) -> None:
    """The fleet of every transport at once: greedy runs, then --concurrency, then the fleet stops."""
    fleet = None
    try:
        init_model = Path(args.peaked) / "a" if args.peaked else write_config(args.model, work)
        start_dir = save_random_hf(init_model, work / "start", seed=2)  # what every rollout serves at start
        rollouts = rollout_layout(transports, gpus, args.tp_size)
        res["rollouts"] = rollouts
        fleet = Fleet()
        fleet.start(
            work, init_model, start_dir, rollouts, args.ready_timeout, inflight=args.concurrency,
            tp_size=args.tp_size, bucket_mb=args.bucket_mb,
        )  # fmt: skip
        greedy_runs(res, fleet, work, transports, prompts, init_model, args, save)
        if args.concurrency:
            save()
            concurrency_run(res, fleet.stubs, prompts, args.concurrency, args.concurrency_tokens)
        from tests.support import sgl_kernel_shim

        res["shim_routes"] = {m: r[0] for m, r in sgl_kernel_shim.ROUTES.items()}
        res["shim_stubbed"] = sorted(sgl_kernel_shim.STUBBED)
    finally:
        if fleet is not None:
            fleet.stop(res)


def main() -> int:
    args = parse()
    # `timeout` sends SIGTERM: unwind through `finally` so the services are stopped and the JSON written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"terminated (SIGTERM) at {time.strftime('%H:%M:%S')}"))
    gpus = torch.cuda.device_count()
    transports = args.transports.split(",") if args.transports else ["ipc", "tcp"] + (["nccl"] if gpus >= 2 else [])
    timing_transports = args.timing_transports.split(",")
    check_gpus(args, transports, timing_transports, gpus)
    if args.tp_size > 1:
        # the trainer sits on cuda:0 only: SGLang's ranks see unequal free memory there by design
        os.environ.setdefault("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "false")
    prompts = peaked_model.PROMPTS if args.peaked else RANDOM_PROMPTS
    res = new_result(args, gpus, prompts)
    work = Path(tempfile.mkdtemp(prefix="ws-sglang-live-"))

    def save():
        sglang_results.save(res, args.out)

    if args.colocated_rl:
        return run_rl(res, work, args, save)
    try:
        if not args.timing_only:
            token_checks(res, work, args, transports, gpus, prompts, save)
        if res["timing_models"]:
            save()
            timing_runs(res, res["timing_models"], work, args, timing_transports, gpus, save)
    except BaseException as exc:  # noqa: BLE001 — SystemExit from SIGTERM too: record, then write
        traceback.print_exc()
        res["error"] = repr(exc)[:3000]
    save()
    print_runs(res)
    print_concurrency(res)
    print_timing(res)
    ok = "error" not in res and all(r.get("error") is None for r in res.get("timing_runs", []))
    if not args.timing_only:
        ok = ok and bool(res["runs"]) and all(r.get("greedy_match") for r in res["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
