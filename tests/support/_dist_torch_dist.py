"""Run under torchrun (gloo, 2 ranks): Megatron torch_dist checkpoints across layouts.

For each family dir given: an actor at TP=2 PP=1 loads the HF weights and saves torch_dist
checkpoints under each key spelling (megatron-core's own, the TE spec's, the module names); then,
at TP=1 PP=2, an actor started from each checkpoint must hold exactly the parameters of an actor at
TP=1 PP=2 loaded from the HF weights, and export exactly the HF tensors. Also: a checkpoint of another
model is refused on every rank with the missing key named. Rank 0 writes a JSON report to --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SPELLINGS = ("megatron", "te", "local")


def _all_ranks_true(flag: bool) -> bool:
    # NCCL on GPU hosts (the same script serves tests/gpu/test_torch_dist_gpu.py), gloo on CPU
    t = torch.tensor([int(flag)], dtype=torch.int64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _params(actor) -> dict[str, torch.Tensor]:
    from trainer_svc.actor.megatron.model import named_parameters_global

    return {k: v.detach().clone() for k, v in named_parameters_global(actor.model).items()}


def _relayout() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(float(os.environ.get("WS_DIST_HANG_S", "170")), exit=True)

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from trainer_svc.actor.megatron.actor import MegatronActor
    from trainer_svc.actor.megatron.dist_ckpt import TRACKER

    rank = int(os.environ["RANK"])
    work = Path(args.work)
    report: dict = {}
    cfgs = {d: AutoConfig.from_pretrained(d, local_files_only=True) for d in args.dirs}
    saved: dict[str, dict[str, str]] = {}
    # 1. TP=2 PP=1: load HF, save under every spelling
    for d, cfg in cfgs.items():
        actor = MegatronActor(cfg, tp=2, pp=1, weights_dir=d)
        saved[d] = {}
        for names in SPELLINGS:
            root = work / f"{actor.family}-{names}"
            saved[d][names] = actor.save_megatron(str(root), iteration=7, names=names)
        from megatron.core import dist_checkpointing

        report[actor.family] = {
            "tracker": (work / f"{actor.family}-megatron" / TRACKER).read_text().strip(),
            "keys": {n: sorted(dist_checkpointing.load_tensors_metadata(p)) for n, p in saved[d].items()},
        }
        dist.barrier()
    _relayout()
    # 2. TP=1 PP=2: each checkpoint against the HF load at this layout
    for d, cfg in cfgs.items():
        ref = MegatronActor(cfg, tp=1, pp=2, weights_dir=d)
        want = _params(ref)
        family = ref.family
        res = report[family]
        for names in SPELLINGS:
            # the root (Megatron-LM layout, tracker file) for one spelling, the iter dir for the others
            src = str(work / f"{family}-{names}") if names == "megatron" else saved[d][names]
            actor = MegatronActor(cfg, tp=1, pp=2, megatron_checkpoint=src, seed=99)
            got = _params(actor)
            same = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
            res[f"params_exact_{names}"] = _all_ranks_true(same)
            res[f"version_{names}"] = actor.version
            if rank == 0:
                try:
                    hf = load_file(str(Path(d) / "model.safetensors"))
                    exported = {k: v.cpu() for k, v in actor.export_tensors()}
                    res[f"export_exact_{names}"] = set(exported) == set(hf) and all(
                        torch.equal(exported[k], hf[k]) for k in hf
                    )
                finally:
                    actor.shutdown()
            else:
                actor.worker_loop()
        dist.barrier()
    # 3. a checkpoint of another model: qwen3 needs q/k norms a qwen2 checkpoint lacks
    fam_dirs = {AutoConfig.from_pretrained(d, local_files_only=True).model_type: d for d in args.dirs}
    if "qwen3" in fam_dirs and "qwen2" in fam_dirs:
        try:
            MegatronActor(cfgs[fam_dirs["qwen3"]], tp=1, pp=2, megatron_checkpoint=str(work / "qwen2-megatron"))
            report["wrong_model_error"] = None
        except ValueError as exc:
            report["wrong_model_error"] = str(exc)
    try:
        MegatronActor(cfgs[args.dirs[0]], tp=1, pp=2, megatron_checkpoint=str(work))
        report["not_a_checkpoint_error"] = None
    except ValueError as exc:
        report["not_a_checkpoint_error"] = str(exc)
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
    # the report is written: end without the interpreter's teardown of torch and megatron (seconds
    # per process on a busy 2-core box, paid by every rank of every launch)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
