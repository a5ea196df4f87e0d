"""Run under torchrun (gloo), one rank per pipeline stage and EP rank: each sender rank's flat buckets
(`MegatronActor.own_flat_buckets`, flat_export.py over the buckets it owns) against its own
per-tensor export (`export_own_tensors`) packed by the pipeline and against the HF checkpoint,
byte for byte, per family and bucket size; then after a step, and with a parameter given new
storage. argv: --out, then a layout's --pp, --vpp, --ep and `family=hf_dir` pairs; further layouts of
the same world size after `--then` run in turn in the same launch (each launch pays megatron's imports
in every rank, a layout only its builds). Rank 0 writes the JSON report: rank -> [one entry per layout,
family and case]. Every rank works on its own (no rank-0 driver, no worker loop): at
TP = expert-TP = 1 neither the own export nor the flat buckets run a collective, which this script
relies on. With --ep > 1 (MoE families) the bf16 cases run in megatron's grouped expert layout too
(`grouped-` cases: the experts are views into weight1/weight2, copied into their slots at each sync)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support._flat_export_cases import CASES, _pack_all, _same  # noqa: E402


def _rank_manifest(actor, bucket: int):
    """This rank's buckets of the multi-sender layout (as run_sender computes it), with its digest."""
    from weightsync.bus.layout import layout_digest
    from weightsync.publisher.multisender import SendJob, sender_manifest

    job = SendJob(
        sync_id="s", version=1, bucket_bytes=bucket, model_family=actor.family, checksum_algo="", origin="",
        digest="", targets={}, macs={}, timeout=1.0,
    )  # fmt: skip
    full = sender_manifest(actor.export_metas(), actor.export_owners(), job)
    mine = replace(full, buckets=full.buckets_of(actor.rank))
    return full, replace(mine, layout_digest=layout_digest(mine))


def run_case(config, hf_dir: str, hf: dict, par: dict, pdt, edt, bucket: int) -> dict:
    from trainer_svc.actor.megatron.actor import MegatronActor

    actor = MegatronActor(config, **par, weights_dir=hf_dir, params_dtype=pdt, export_dtype=edt)
    full, m = _rank_manifest(actor, bucket)
    r: dict = {"buckets": len(m.buckets), "senders": full.senders, "names": [x.name for x in m.metas()]}
    r["model_tensors"] = len(full.metas())
    ref = [(x.name, hf[x.name].to(edt)) for x in m.metas()]
    # the rank's own export (no collective at TP=1), packed as the pipeline packs it
    packed = _pack_all(m, actor.export_own_tensors())
    r["iter_vs_hf"] = _same(m, packed, ref)
    flats = actor.own_flat_buckets(m)
    fe = actor.flat.plan
    if flats is None:
        r["flat"] = False
        return r
    r["flat"] = True
    r["flat_vs_iter"] = [b.index for b, f, w in zip(m.buckets, flats, packed) if not torch.equal(f[: b.nbytes], w)]
    r["flat_vs_hf"] = _same(m, flats, ref)
    r["aliased_bytes"], r["copied_bytes"], r["copies"] = fe.aliased_bytes, fe.copied_bytes, fe.copies
    r["total_bytes"] = sum(x.nbytes for x in m.metas())
    # a training step changes the parameters in place: the next sync's buckets follow
    with torch.no_grad():
        for i, p in enumerate(actor.parameters()):
            p.add_(0.25 * (i + 1))
    again = actor.own_flat_buckets(m)
    r["reused"] = again is flats and actor.flat.plan is fe
    stepped = _pack_all(m, actor.export_own_tensors())
    r["after_step_vs_iter"] = [
        b.index for b, f, w in zip(m.buckets, again, stepped) if not torch.equal(f[: b.nbytes], w)
    ]
    r["after_step_changed"] = not all(torch.equal(a[: b.nbytes], w) for a, b, w in zip(again, m.buckets, packed))
    # a load that gives a parameter new storage: the plan is stale and made again (one this rank
    # sends: a second EP rank also holds the dense replicas, which are the dense leader's to send)
    # (a grouped layout's weight1: the plan reads its experts through views, which keep their address)
    planned = {id(p) for p, _ in fe._sources}
    grouped = [p for c in actor.model for n, p in c.named_parameters() if n.endswith(".experts.weight1")]
    p0 = next(p for p in grouped + actor.parameters()[1:] if id(p) in planned)
    p0.data = p0.data.clone() + 1
    fresh = actor.own_flat_buckets(m)
    r["replanned"] = actor.flat.plan is not fe
    latest = _pack_all(m, actor.export_own_tensors())
    r["stale_vs_iter"] = [b.index for b, f, w in zip(m.buckets, fresh, latest) if not torch.equal(f[: b.nbytes], w)]
    # the whole-model path stays rank 0's at TP=PP=EP=1 only
    r["whole_is_none"] = actor.flat_buckets(replace(full, layout_digest="x")) is None
    return r


def main() -> None:
    out, runs = split_runs(sys.argv[1:])
    report = []
    for argv in runs:
        ap = argparse.ArgumentParser()
        ap.add_argument("--pp", type=int, default=2)
        ap.add_argument("--vpp", type=int, default=1)
        ap.add_argument("--ep", type=int, default=1)
        ap.add_argument("dirs", nargs="+", help="family=hf_dir pairs")
        args = ap.parse_args(argv)
        report.append(run_layout(args))
    write_report(report, out)


def run_layout(args) -> dict:
    """family -> case -> this rank's report, for one layout; its parallel state destroyed after."""
    from megatron.core import parallel_state as ps

    # a hang in a collective should leave stacks behind, not only a test timeout (re-armed per layout)
    faulthandler.dump_traceback_later(float(os.environ.get("WS_DIST_HANG_S", "400")), exit=True)
    par = dict(pp=args.pp, vpp=args.vpp, ep=args.ep)
    report: dict = {}
    for arg in args.dirs:
        family, hf_dir = arg.split("=", 1)
        config, hf = read_hf(hf_dir)
        rep = report[family] = {}
        run_cases(rep, CASES, run_case, config, hf_dir, hf, par)
        # parameters in another dtype than the export: every rank packs (the pack path casts)
        cast_declines(rep, config, hf_dir, par)
        if args.ep > 1:
            from tests.support._dist_moe import _install_grouped_gemm_stand_in

            _install_grouped_gemm_stand_in()
            bf16 = [c for c in CASES if c[0] == c[1] == torch.bfloat16]  # megatron's GroupedMLP runs in bf16 only
            run_cases(rep, bf16, run_case, config, hf_dir, hf, dict(par, expert_layout="grouped"), prefix="grouped-")
    ps.destroy_model_parallel()  # the next layout initialises its own groups
    return report


def split_runs(argv: list[str]) -> tuple[str, list[list[str]]]:
    """(--out's value, each layout's arguments): `--out OUT` first, layouts separated by `--then`."""
    if len(argv) < 3 or argv[0] != "--out":
        raise SystemExit("usage: --out OUT LAYOUT_ARGS [--then LAYOUT_ARGS ...]")
    runs: list[list[str]] = [[]]
    for a in argv[2:]:
        if a == "--then":
            runs.append([])
        else:
            runs[-1].append(a)
    return argv[1], runs


def read_hf(hf_dir: str):
    """(the HF config, every tensor of the checkpoint) of `hf_dir`."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    hf = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        hf.update(load_file(str(f)))
    return AutoConfig.from_pretrained(hf_dir, local_files_only=True), hf


def run_cases(rep: dict, cases, run, config, hf_dir: str, hf: dict, par: dict, prefix: str = "") -> None:
    """rep[<prefix><params dtype>-<bucket bytes>] = run(...)'s report of each case, or its traceback."""
    for pdt, edt, bucket in cases:
        key = f"{prefix}{str(pdt)[6:]}-{bucket}"
        try:
            rep[key] = run(config, hf_dir, hf, par, pdt, edt, bucket)
        except Exception:
            rep[key] = {"error": traceback.format_exc()}


def cast_declines(rep: dict, config, hf_dir: str, par: dict, then=None) -> None:
    """rep["cast_flat_is_none"]: whether a float32 model exported in bf16 declines the flat path (its
    slots would be a model-sized copy); `then(actor, manifest)` runs after (the TP group's export)."""
    from trainer_svc.actor.megatron.actor import MegatronActor

    try:
        cast = MegatronActor(config, **par, weights_dir=hf_dir, params_dtype=torch.float32, export_dtype=torch.bfloat16)
        m = _rank_manifest(cast, 1 << 22)[1]
        rep["cast_flat_is_none"] = cast.own_flat_buckets(m) is None
        if then is not None:
            then(cast, m)
    except Exception:
        rep["cast_flat_is_none"] = traceback.format_exc()


def write_report(report: dict, out: str) -> None:
    """Every rank's report, gathered into `out` by rank 0; then the process group ends."""
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, report)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({str(i): t for i, t in enumerate(table)}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # the report is written: end without the interpreter's teardown of torch and megatron (seconds
    # per process on a busy 2-core box, paid by every rank of every launch)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
