"""Run under torchrun (gloo): built-in rules vs mbridge on the same Megatron model, per family dir.

For each HF dir: actor A loads with the built-in rules, actor B with converter=mbridge. Checked:
every rank's Megatron parameters of A and B are equal (load); mbridge's export of A's chunks and
the built-in export of A are the same name -> tensor map (export alone); B's export through the
actor (rank 0 drives, workers in worker_loop) equals the original safetensors, follows
export_metas() exactly, and survives an early close. Rank 0 writes a JSON report to --out.
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


def _all_ranks(ok: bool) -> bool:
    t = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _driven_export(actor, rank: int, save_to: Path | None = None) -> list | None:
    """Rank 0: the actor's public export (+ an early-closed one first, + save_hf); others serve it."""
    if rank != 0:
        actor.worker_loop()
        return None
    try:
        it = actor.export_tensors()
        next(it)
        it.close()  # the workers must still finish the bridge's collectives
        if save_to is not None:
            actor.save_hf(str(save_to))  # stops pulling after the last planned tensor
        return list(actor.export_tensors())
    finally:
        actor.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True)
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(float(os.environ.get("WS_DIST_HANG_S", "170")), exit=True)

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from trainer_svc.actor.megatron.actor import MegatronActor
    from trainer_svc.actor.megatron.bridge import make_converter
    from weightsync.bus.dtypes import parse_dtype

    rank = int(os.environ["RANK"])
    dtype = parse_dtype(args.dtype)
    report = {}
    for d in args.dirs:
        res: dict = {}
        try:
            cfg = AutoConfig.from_pretrained(d, local_files_only=True)
            kw = dict(tp=args.tp, pp=args.pp, vpp=args.vpp, export_dtype=dtype, weights_dir=d)
            ref = MegatronActor(cfg, **kw)
            br = MegatronActor(cfg, converter="mbridge", **kw)
            res["family"] = ref.family
            pa, pb = [dict(c.named_parameters()) for c in ref.model], [dict(c.named_parameters()) for c in br.model]
            res["load_equal"] = _all_ranks(
                all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(pa, pb))
            )
            # the bridge alone, on the chunks the built-in rules loaded: a collective on every rank
            conv = make_converter("mbridge", ref.spec, ref.par, torch.float32)
            bridge_map = dict(conv.export(ref.model, br.export_metas()))
            builtin = _driven_export(ref, rank)
            saved = Path(args.out).parent / f"saved-{Path(d).name}"
            via_actor = _driven_export(br, rank, saved)
            if rank == 0:
                want = {n: t.to(dtype) for n, t in load_file(str(Path(d) / "model.safetensors")).items()}
                builtin_map = dict(builtin)
                res["export_same_names"] = sorted(bridge_map) == sorted(builtin_map)
                res["export_mismatch"] = [
                    n
                    for n in builtin_map
                    if n not in bridge_map
                    or bridge_map[n].dtype != builtin_map[n].dtype
                    or not torch.equal(bridge_map[n], builtin_map[n])
                ]
                on_disk = load_file(str(saved / "model.safetensors"))
                res["saved_exact"] = on_disk.keys() == {n for n, _ in via_actor} and all(
                    torch.equal(on_disk[n], t) for n, t in via_actor
                )
                res["actor_mismatch"] = [n for n, t in via_actor if n not in want or not torch.equal(t, want[n])]
                res["actor_missing"] = sorted(
                    set(want) - {n for n, _ in via_actor} - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
                )
                res["metas_match"] = [(m.name, tuple(m.shape), m.dtype) for m in br.export_metas()] == [
                    (n, tuple(t.shape), t.dtype) for n, t in via_actor
                ]
                res["order_differs"] = [n for n, _ in via_actor] != [m.name for m in ref.export_metas()]
        except Exception:
            res["error"] = traceback.format_exc()
        report[Path(d).name] = res
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
    faulthandler.cancel_dump_traceback_later()
    os._exit(0)  # gloo's teardown is flaky under torchrun; the report is written


if __name__ == "__main__":
    main()
