"""Run under torchrun (gloo): for each TP/PP/VPP layout given (all of one world size: one launch pays
megatron's imports once for them) and each family dir, HF -> Megatron -> HF.

Every rank builds the actor (a collective load). Then rank 0 drives through the public API while
the other ranks sit in `worker_loop()`: export_tensors (compared bit-exactly with the original
safetensors; before that, every rank's own export without the rank-0 funnel, the multi-sender path), export_metas
vs what was yielded, save_hf, an early-stopped export, shutdown. With PP=1
all ranks then run a forward and rank 0 compares logits with transformers. Rank 0 writes a JSON
report to --out.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", action="append", required=True, help="TP,PP,VPP; repeat for several")
    ap.add_argument("--out", required=True)
    ap.add_argument("dirs", nargs="+", help="HF dirs, one per family")
    args = ap.parse_args()
    from megatron.core import parallel_state as ps

    rank = int(os.environ["RANK"])
    report = {}
    for layout in args.layout:
        # a hang in a collective should leave stacks behind, not only a test timeout (re-armed per layout)
        faulthandler.dump_traceback_later(float(os.environ.get("WS_DIST_HANG_S", "170")), exit=True)
        tp, pp, vpp = (int(x) for x in layout.split(","))
        report[layout] = _roundtrip(args, tp, pp, vpp, rank)
        ps.destroy_model_parallel()  # the next layout initialises its own groups
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


def _roundtrip(args, tp: int, pp: int, vpp: int, rank: int) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.support.own_export import check_hf_tensors_helper, check_own_export
    from trainer_svc.actor.megatron.actor import MegatronActor
    from trainer_svc.actor.megatron.model import forward_logits

    report = {}
    for d in args.dirs:
        cfg = AutoConfig.from_pretrained(d, local_files_only=True)
        actor = MegatronActor(cfg, tp=tp, pp=pp, vpp=vpp, weights_dir=d)
        res = {"family": actor.family}
        # a tied model at PP>1 keeps a second copy of the embedding as the last stage's head; it is
        # never exported, so check it here against this rank's vocab rows of the HF embedding
        ok = torch.tensor([1], dtype=torch.int64)
        head = dict(actor.model[-1].named_parameters()).get("output_layer.weight")
        if actor.family.endswith("-tied") and head is not None:
            from megatron.core import parallel_state as ps

            emb = load_file(str(Path(d) / "model.safetensors"))["model.embed_tokens.weight"]
            n = head.shape[0]
            rows = emb[ps.get_tensor_model_parallel_rank() * n :][:n]
            ok[0] = int(
                torch.equal(head.detach()[: rows.shape[0]], rows) and bool((head.detach()[rows.shape[0] :] == 0).all())
            )
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        res["tied_head_ok"] = bool(ok.item())
        # multi-sender export, every rank at once: each yields exactly its own tensors
        res["own_export_ok"], res["senders"] = check_own_export(actor, load_file(str(Path(d) / "model.safetensors")))
        # the helper a user's own loop calls (trainer_svc.actor.megatron.hf_tensors), layout read from
        # megatron's parallel state: each rank yields the same as the actor's own export, in order
        res["helper_ok"] = check_hf_tensors_helper(actor)
        if rank != 0:
            actor.worker_loop()
        else:
            try:
                want = load_file(str(Path(d) / "model.safetensors"))
                got = list(actor.export_tensors())
                res["names"] = [n for n, _ in got]
                res["mismatch"] = [n for n, t in got if n not in want or not torch.equal(t, want[n])]
                res["missing"] = sorted(set(want) - {n for n, _ in got})
                res["metas_match"] = [(m.name, list(m.shape), str(m.dtype)) for m in actor.export_metas()] == [
                    (n, list(t.shape), str(t.dtype)) for n, t in got
                ]
                it = actor.export_tensors()
                next(it)
                it.close()  # stops early: the actor must still finish the collectives
                out = Path(args.out).parent / f"saved-{actor.family}-{tp}{pp}{vpp}"
                actor.save_hf(str(out))
                reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
                ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
                rsd, fsd = reloaded.state_dict(), ref.state_dict()
                res["saved_exact"] = set(rsd) == set(fsd) and all(torch.equal(rsd[k], fsd[k]) for k in fsd)
                res["version"] = actor.version
            except Exception:
                res["error"] = traceback.format_exc()
            finally:
                actor.shutdown()
        if pp == 1:
            torch.manual_seed(0)
            ids = torch.randint(0, cfg.vocab_size, (2, 16))
            with torch.no_grad():
                logits = forward_logits(actor.model, ids, cfg.vocab_size)
            if rank == 0:
                ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
                with torch.no_grad():
                    want = ref(ids).logits
                res["logits_rel_err"] = float((logits - want).norm() / want.norm())
        report[actor.family] = res
        dist.barrier()
    return report


if __name__ == "__main__":
    main()
    # the report is written: end without the interpreter's teardown of torch and megatron (seconds
    # per process on a busy 2-core box, paid by every rank of every launch)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
