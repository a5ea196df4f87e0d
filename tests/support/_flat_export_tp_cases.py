"""Run under torchrun, tp * pp * ep ranks: the flat export at TP > 1 (flat_export.py with the TP
exchange of tp_gather.py) against the per-tensor export packed by the pipeline and the HF checkpoint,
byte for byte, on CPU (gloo) or one GPU per rank (NCCL: tests/gpu/test_flat_export_tp_gpu.py).
argv: --out, then a layout's --tp, --pp, --ep, --etp, --cases and `family=hf_dir` pairs; further
layouts of the same world size after `--then` run in turn in the same launch (FLAT_CASES_KERNEL=1: the
copies through the Triton copy kernel, as _flat_export_cases.py). Rank 0 writes the JSON report:
rank -> [one entry per layout, family and case].

Per case every rank calls, together, what a multi-sender sync calls on it (run_sender): its own
export packed, then `own_flat_buckets` over its own buckets (the stage leader's, and an EP rank's
experts; none on the other TP ranks, which send their shards); again after a step; again after one
sharded parameter got new storage on every rank (the leader replans, the others send the new
storage); and once with a TP rank declining (`decline_own_flat`): the whole group must then export.
At PP = EP = 1 the single sender too: rank 0's `flat_buckets` of the whole model while the other
ranks serve `worker_loop` (the `flat_join` command).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support._flat_export_cases import CASES, _force_kernel, _pack_all, _same  # noqa: E402
from tests.support._flat_export_pp_cases import (  # noqa: E402
    _rank_manifest,
    cast_declines,
    read_hf,
    run_cases,
    split_runs,
    write_report,
)


def _packed(m, export) -> list[torch.Tensor]:
    """An export packed into `m`'s buckets, drained to its end: a rank without buckets still takes
    part in its TP group's gathers."""
    it = iter(export)
    out = _pack_all(m, it)
    for _ in it:
        pass
    return out


def _differ(m, flats, packed) -> list[int]:
    """Indices of the buckets that differ (compared in host memory: on GPUs the flat buckets live there)."""
    return [
        b.index for b, f, w in zip(m.buckets, flats, packed, strict=True) if not torch.equal(f[: b.nbytes].cpu(), w)
    ]


def run_case(config, hf_dir: str, hf: dict, par: dict, pdt, edt, bucket: int) -> dict:
    from trainer_svc.actor.megatron.actor import MegatronActor
    from trainer_svc.actor.megatron.model import named_parameters_global
    from trainer_svc.actor.megatron.tp_gather import sharded_names

    actor = MegatronActor(config, **par, weights_dir=hf_dir, params_dtype=pdt, export_dtype=edt)
    full, m = _rank_manifest(actor, bucket)
    r: dict = {"buckets": len(m.buckets), "senders": full.senders, "names": [x.name for x in m.metas()]}
    r.update(tp_rank=actor.rmap.tp_rank, replica0=actor.rmap.in_replica0)
    r["model_tensors"] = len(full.metas())
    ref = [(x.name, hf[x.name].to(edt)) for x in m.metas()]
    packed = _packed(m, actor.export_own_tensors())  # collective: every rank
    r["iter_vs_hf"] = _same(m, packed, ref)
    flats = actor.own_flat_buckets(m)  # collective: every rank
    fe = actor.flat.plan
    r["flat"] = flats is not None
    if flats is None:
        return r
    r["flat_vs_iter"] = _differ(m, flats, packed)
    r["flat_vs_hf"] = _same(m, [f.cpu() for f in flats], ref)
    if fe is not None:
        r.update(
            aliased_bytes=fe.aliased_bytes,
            copied_bytes=fe.copied_bytes,
            landed_bytes=fe.landed_bytes,
            received_bytes=fe.received_bytes,
            gather_buffer_bytes=fe.gather_buffer_bytes,
            copies=fe.copies,
            launches=fe.launches,
            torch_copies=fe.torch_copies,
            total_bytes=sum(x.nbytes for x in m.metas()),
        )
    # a training step changes the parameters in place (each rank its own shards): the next buckets follow
    with torch.no_grad():
        for i, p in enumerate(actor.parameters()):
            p.add_(0.25 * (i + 1))
    again = actor.own_flat_buckets(m)
    # the leader's plan (its gather buffer included) is reused; the other ranks only sent again
    r["reused"] = again is flats and actor.flat.plan is fe if fe is not None else again == []
    stepped = _packed(m, actor.export_own_tensors())
    r["after_step_vs_iter"] = _differ(m, again, stepped)
    r["after_step_changed"] = bool(_differ(m, again, packed)) or not m.buckets
    # a load that gives a sharded parameter new storage on every rank: the leader's plan is stale and
    # made again, the other ranks send the new storage
    name = sharded_names(actor.spec, actor.par, actor.rmap.pp_rank)[0]
    p0 = named_parameters_global(actor.model)[name]
    p0.data = p0.data.clone() + 1
    fresh = actor.own_flat_buckets(m)
    # (a plan that does not read it, an EP rank's experts alone, stays as it was)
    r["replanned"] = fe is None or actor.flat.plan is not fe or not any(p is p0 for p, _ in fe._sources)
    latest = _packed(m, actor.export_own_tensors())
    r["stale_vs_iter"] = _differ(m, fresh, latest)
    # one TP rank declines (a delta base kept elsewhere): the whole group exports, nobody waits
    if actor.rmap.tp_rank == actor.par.tp - 1:
        actor.decline_own_flat(m)
        r["declined"] = True
    else:
        r["declined"] = actor.own_flat_buckets(m) is None
    r["after_decline_vs_iter"] = _differ(m, _packed(m, actor.export_own_tensors()), latest)
    if (actor.par.pp, actor.par.ep) == (1, 1):  # the single sender's flat path
        r["funnel"] = _funnel(actor, full, hf)
    return r


def _funnel(actor, full, hf) -> dict | None:
    """Rank 0's whole-model flat buckets (single sender) at TP > 1, the others in worker_loop."""
    from weightsync.bus.layout import layout_digest

    if actor.rank != 0:
        actor.worker_loop()
        return None
    m = replace(full, layout_digest=layout_digest(full))
    flats = actor.flat_buckets(m)
    out: dict = {"flat": flats is not None}
    if flats is not None:
        packed = _packed(m, actor.export_tensors())
        out["flat_vs_iter"] = _differ(m, flats, packed)
        again = actor.flat_buckets(m)
        out["reused"] = again is flats
        out["again_vs_iter"] = _differ(m, again, packed)
    actor.shutdown()
    return out


def main() -> None:
    out, runs = split_runs(sys.argv[1:])
    if os.environ.get("FLAT_CASES_KERNEL") == "1":
        _force_kernel()
    write_report([run_layout(argv) for argv in runs], out)


def run_layout(argv: list[str]) -> dict:
    """family -> case -> this rank's report, for one layout; its parallel state destroyed after."""
    from megatron.core import parallel_state as ps

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--cases", default="", help="indices into CASES, comma-separated (default: all)")
    ap.add_argument("dirs", nargs="+", help="family=hf_dir pairs")
    args = ap.parse_args(argv)
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    # a hang in a collective should leave stacks behind, not only a test timeout (re-armed per layout)
    faulthandler.dump_traceback_later(float(os.environ.get("WS_DIST_HANG_S", "400")), exit=True)

    par = dict(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    report: dict = {}
    for arg in args.dirs:
        family, hf_dir = arg.split("=", 1)
        config, hf = read_hf(hf_dir)
        rep = report[family] = {}
        run_cases(rep, cases, run_case, config, hf_dir, hf, par)
        # parameters in another dtype than the export: the leader refuses, so every rank exports
        # (every rank runs the export's gathers: no one waits in the exchange)
        cast_declines(rep, config, hf_dir, par, then=lambda actor, m: _packed(m, actor.export_own_tensors()))
    ps.destroy_model_parallel()  # the next layout initialises its own groups
    return report


if __name__ == "__main__":
    main()
    # the report is written: end without the interpreter's teardown of torch and megatron (seconds
    # per process on a busy 2-core box, paid by every rank of every launch)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
