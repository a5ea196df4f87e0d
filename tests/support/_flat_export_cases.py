"""One megatron-core process (one-rank gloo group): the flat export (flat_export.py) against the HF
checkpoint it loaded and against the per-tensor export packed by the pipeline, byte for byte.
argv: the report path, then `family=hf_dir` pairs. Writes a JSON report. With FLAT_CASES_KERNEL=1 (and
TRITON_INTERPRET=1 on a machine without a GPU) the converted copies go through the Triton copy kernel
(weightsync/bus/copy_runs_cuda.py) instead of torch's, as on a GPU."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (parameter dtype, export dtype, bucket bytes): one bucket for the model; small buckets (gate and
# up of a layer land in different buckets, the embedding travels alone); fp32 parameters
CASES = [
    (torch.bfloat16, torch.bfloat16, 1 << 22),
    (torch.bfloat16, torch.bfloat16, 20_000),
    (torch.float32, torch.float32, 50_000),
]


def _packed(plan, named) -> torch.Tensor:
    from weightsync.bus.pack import pack_bucket

    buf = torch.zeros(plan.nbytes, dtype=torch.uint8)  # gaps zero, as the flat buckets' are
    return pack_bucket(plan, named, buf).clone()


def _pack_all(manifest, named) -> list[torch.Tensor]:
    it = iter(named)
    return [_packed(plan, (next(it) for _ in plan.slots)) for plan in manifest.buckets]


def _same(manifest, flats, named) -> list[int]:
    """Indices of the buckets whose bytes differ from `named` packed into that bucket."""
    it = iter(named)
    bad = []
    for plan, flat in zip(manifest.buckets, flats, strict=True):
        want = _packed(plan, (next(it) for _ in plan.slots))
        if not torch.equal(flat[: plan.nbytes], want):
            bad.append(plan.index)
    return bad


def run_family(family: str, hf_dir: str) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from trainer_svc.actor.megatron.actor import MegatronActor
    from trainer_svc.actor.megatron.model import forward_logits
    from weightsync.bus.layout import ManifestCache

    config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    hf = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        hf.update(load_file(str(f)))
    rep: dict = {}
    for pdt, edt, bucket in CASES:
        key = f"{str(pdt)[6:]}-{bucket}"
        r = rep[key] = {}
        actor = MegatronActor(config, weights_dir=hf_dir, params_dtype=pdt, export_dtype=edt)
        metas = actor.export_metas()
        m = ManifestCache().manifest(metas, version=1, sync_id="s", bucket_bytes=bucket, model_family=actor.family)
        r["buckets"] = len(m.buckets)
        ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            before = forward_logits(actor.model, ids, config.vocab_size)
        ref = [(x.name, hf[x.name].to(edt)) for x in metas]
        # the per-tensor export (export.py) packed as the pipeline does, against the checkpoint
        flats_iter = _pack_all(m, actor.export_tensors())
        r["iter_vs_hf"] = _same(m, flats_iter, ref)
        flats = actor.flat_buckets(m)
        fe = actor._flat
        r["flat_vs_hf"] = _same(m, flats, ref)
        r["aliased_bytes"], r["copied_bytes"], r["copies"] = fe.aliased_bytes, fe.copied_bytes, fe.copies
        r["launches"], r["torch_copies"] = fe.launches, fe.torch_copies
        r["total_bytes"] = sum(x.nbytes for x in metas)
        with torch.no_grad():
            after = forward_logits(actor.model, ids, config.vocab_size)
        r["logits_unchanged"] = torch.equal(before, after)
        r["flat_storage"] = (
            all(
                p.untyped_storage().data_ptr() in {f.untyped_storage().data_ptr() for f in flats}
                for p in actor.parameters()
            )
            if fe.copies == 0
            else None
        )
        # a training step changes the parameters in place: the next sync's buckets follow
        with torch.no_grad():
            for i, p in enumerate(actor.parameters()):
                p.add_(0.25 * (i + 1))
        again = actor.flat_buckets(m)
        r["reused"] = again is flats and actor._flat is fe
        r["after_step_vs_iter"] = _same(m, again, list(actor.export_tensors()))
        r["after_step_changed"] = not all(
            torch.equal(a[: b.nbytes], b2) for a, b, b2 in zip(again, m.buckets, flats_iter)
        )
        # a load that gives a parameter new storage: the plan is stale and made again
        p0 = actor.parameters()[1]
        p0.data = p0.data.clone() + 1
        fresh = actor.flat_buckets(m)
        r["replanned"] = actor._flat is not fe
        r["stale_vs_iter"] = _same(m, fresh, list(actor.export_tensors()))
        actor.shutdown()
    # parameters in another dtype than the export: no flat buckets (the pack path casts)
    cast = MegatronActor(config, weights_dir=hf_dir, params_dtype=torch.float32, export_dtype=torch.bfloat16)
    m = ManifestCache().manifest(cast.export_metas(), version=1, sync_id="s", bucket_bytes=1 << 22)
    rep["cast_flat_is_none"] = cast.flat_buckets(m) is None
    ref = [(x.name, hf[x.name].to(torch.bfloat16)) for x in cast.export_metas()]
    rep["cast_iter_vs_hf"] = _same(m, _pack_all(m, cast.export_tensors()), ref)
    return rep


def _force_kernel() -> None:
    from weightsync.bus import copy_runs

    plain = copy_runs.BatchedCopy.__init__

    def init(self, pairs, *, use_kernel=None):
        plain(self, pairs, use_kernel=True)

    copy_runs.BatchedCopy.__init__ = init


def main() -> None:
    if os.environ.get("FLAT_CASES_KERNEL") == "1":
        _force_kernel()
    out = Path(sys.argv[1])
    report: dict = {}
    for arg in sys.argv[2:]:
        family, hf_dir = arg.split("=", 1)
        try:
            report[family] = run_family(family, hf_dir)
        except Exception:
            report[family] = {"error": traceback.format_exc()}
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
