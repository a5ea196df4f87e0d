"""Run under torchrun (gloo, 2 ranks): MoE / EP and MTP conversion at several layouts in ONE launch.

For each layout (megatron's parallel state is torn down and rebuilt between layouts) and each HF dir
that fits it: HF -> Megatron -> HF bit-exact (export_tensors against the safetensors, export_metas,
the file save_hf writes), and logits against transformers at PP=1. At EP=2 also: errors that only
one EP rank sees are raised on both, and the converter's to-megatron / to-hf at EP=2 with MTP.
Rank 0 writes a JSON report to --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import sys
import traceback
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# layout name -> (MegatronActor parallel kwargs, cases: (dir key, mtp, expert layout))
LAYOUTS = {
    "ep2": (
        dict(ep=2),
        [
            ("qwen3_moe", "off", "sequential"),
            ("qwen2_moe", "off", "sequential"),
            ("qwen3_moe-mtp", "deepseek", "sequential"),
            ("qwen2_moe-bf16", "off", "grouped"),
        ],
    ),
    "tp2": (
        dict(tp=2),
        [
            ("qwen3_moe", "off", "sequential"),
            ("qwen2_moe", "off", "sequential"),
            ("qwen3_moe-mtp", "deepseek", "sequential"),
            ("qwen2-mtp", "mimo", "sequential"),
        ],
    ),
    "tp2-ep2-etp1": (
        dict(tp=2, ep=2, etp=1),
        [("qwen3_moe-mtp", "deepseek", "sequential"), ("qwen2_moe-bf16", "off", "grouped")],
    ),
    "pp2-vpp2": (
        dict(pp=2, vpp=2),
        [
            ("qwen3_moe-mtp", "deepseek", "sequential"),
            ("qwen2-mtp", "mimo", "sequential"),
            ("qwen2_moe", "off", "sequential"),
        ],
    ),
}


def _install_grouped_gemm_stand_in() -> None:
    """megatron's legacy GroupedMLP needs the CUDA-only `grouped_gemm` package; this per-expert matmul
    loop computes what its `ops.gmm` computes, so the layout can be built and run on a CPU."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    def gmm(a, b, batch_sizes, trans_b=False):
        out, start = [], 0
        for e, n in enumerate(batch_sizes.tolist()):
            out.append(a[start : start + n] @ (b[e].t() if trans_b else b[e]))
            start += n
        return torch.cat(out)

    gg.grouped_gemm = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=gmm))
    gg.ops = gg.grouped_gemm.ops


def _hf_state(d: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(d) / "model.safetensors"))


def _error_on_all_ranks(fn) -> dict:
    """Run fn on every rank: this rank's ValueError message and on how many ranks it raised."""
    msg = ""
    try:
        fn()
    except ValueError as e:
        msg = str(e)
    n = torch.tensor([int(bool(msg))])
    dist.all_reduce(n)
    return {"message": msg, "ranks_raised": int(n.item())}


def _case(dirs: dict, key: str, mtp: str, layout: str, par: dict, rank: int, work: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer_svc.actor.megatron.actor import MegatronActor
    from trainer_svc.actor.megatron.model import forward_logits

    d = dirs[key]
    grouped = layout == "grouped"
    dtype = torch.bfloat16 if grouped else torch.float32
    cfg = AutoConfig.from_pretrained(d, local_files_only=True)
    actor = MegatronActor(
        cfg, weights_dir=d, mtp=mtp, expert_layout=layout, params_dtype=dtype, export_dtype=dtype, **par
    )
    from tests.support.own_export import check_hf_tensors_helper, check_own_export

    res = {}
    # multi-sender export, every rank at once: each yields exactly its own tensors (experts: EP leaders)
    res["own_export_ok"], res["senders"] = check_own_export(actor, _hf_state(d))
    res["helper_ok"] = check_hf_tensors_helper(actor)  # experts on their EP leaders, MTP layers too
    if rank != 0:
        actor.worker_loop()
    else:
        try:
            want = _hf_state(d)
            got = list(actor.export_tensors())
            res["mismatch"] = [n for n, t in got if n not in want or not torch.equal(t, want[n])]
            res["missing"] = sorted(set(want) - {n for n, _ in got})
            res["metas_match"] = [(m.name, list(m.shape), str(m.dtype)) for m in actor.export_metas()] == [
                (n, list(t.shape), str(t.dtype)) for n, t in got
            ]
            out = work / f"saved-{key}-{'-'.join(f'{k}{v}' for k, v in par.items())}"
            actor.save_hf(str(out))
            saved = _hf_state(str(out))
            res["saved_exact"] = set(saved) == set(want) and all(torch.equal(saved[k], want[k]) for k in want)
        except Exception:
            res["error"] = traceback.format_exc()
        finally:
            actor.shutdown()
    if par.get("pp", 1) == 1:
        torch.manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (2, 16))
        with torch.no_grad():
            logits = forward_logits(actor.model, ids, cfg.vocab_size).float()
        if rank == 0:
            ref = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
            with torch.no_grad():
                ref_logits = ref(ids).logits.float()
            res["logits_rel_err"] = float((logits - ref_logits).norm() / ref_logits.norm())
    return res


def _errors_at_ep2(dirs: dict, rank: int, work: Path) -> dict:
    """Failures that only EP rank 1 can see must still fail on both ranks, naming the tensor."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from trainer_svc.actor.megatron.actor import MegatronActor

    rep = {}
    src = Path(dirs["qwen3_moe"])
    bad = work / "missing-expert"
    if rank == 0:
        shutil.copytree(src, bad)
        sd = load_file(str(bad / "model.safetensors"))
        del sd["model.layers.2.mlp.experts.3.up_proj.weight"]  # expert 3 lives on EP rank 1
        save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()
    cfg = AutoConfig.from_pretrained(str(src), local_files_only=True)
    rep["missing_expert"] = _error_on_all_ranks(lambda: MegatronActor(cfg, ep=2, weights_dir=str(bad)))
    more = AutoConfig.from_pretrained(str(src), local_files_only=True, num_experts=8)
    rep["expert_count"] = _error_on_all_ranks(lambda: MegatronActor(more, ep=2, weights_dir=str(src)))
    wider = AutoConfig.from_pretrained(str(src), local_files_only=True, moe_intermediate_size=48)
    rep["expert_shape"] = _error_on_all_ranks(lambda: MegatronActor(wider, ep=2, weights_dir=str(src)))
    return rep


def _convert_at_ep2(dirs: dict, rank: int, work: Path) -> dict:
    from trainer_svc.actor.megatron.convert import to_hf, to_megatron

    ck, back = work / "ck-ep2", work / "hf-ep2"
    to_megatron(dirs["qwen3_moe-mtp"], str(ck), 1, 1, 1, ep=2, mtp="deepseek")
    to_hf(str(ck), str(back), "float32")
    dist.barrier()
    if rank != 0:
        return {}
    want, got = _hf_state(dirs["qwen3_moe-mtp"]), _hf_state(str(back))
    return {
        "files": sorted(f.name for f in ck.glob("mp_rank_*.pt")),
        "exact": set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dirs", required=True, help="JSON object: dir key -> HF dir")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(float(os.environ.get("WS_DIST_HANG_S", "170")), exit=True)
    from megatron.core import parallel_state as ps

    _install_grouped_gemm_stand_in()
    dirs = json.loads(args.dirs)
    work = Path(args.out).parent
    rank = int(os.environ["RANK"])
    report: dict = {}
    for name, (par, cases) in LAYOUTS.items():
        for key, mtp, layout in cases:
            report[f"{name}/{key}/{layout}"] = _case(dirs, key, mtp, layout, par, rank, work)
            dist.barrier()
        if name == "ep2":
            report["errors"] = _errors_at_ep2(dirs, rank, work)
            report["convert"] = _convert_at_ep2(dirs, rank, work)
        ps.destroy_model_parallel()
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # the report is written: end without the interpreter's teardown of torch and megatron (seconds
    # per process on a busy 2-core box, paid by every rank of every launch)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
