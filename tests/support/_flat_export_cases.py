"""One megatron-core process (one-rank gloo group): the flat export (flat_export.py) against the HF
checkpoint it loaded and against the per-tensor export packed by the pipeline, byte for byte.
argv: the report path, then `family=hf_dir` pairs. Writes a JSON report. With FLAT_CASES_KERNEL=1 (and
TRITON_INTERPRET=1 on a machine without a GPU) the converted copies go through the Triton copy kernel
(weightsync/bus/copy/copy_runs_triton.py) instead of torch's, as on a GPU."""

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
#: bucket bytes of the block-FP8 cases: the model in one bucket; small buckets (scales and weights apart)
FP8_BUCKETS = [1 << 22, 20_000]


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
        fe = actor.flat.plan
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
        r["reused"] = again is flats and actor.flat.plan is fe
        r["after_step_vs_iter"] = _same(m, again, list(actor.export_tensors()))
        r["after_step_changed"] = not all(
            torch.equal(a[: b.nbytes], b2) for a, b, b2 in zip(again, m.buckets, flats_iter)
        )
        # a load that gives a parameter new storage: the plan is stale and made again
        p0 = actor.parameters()[1]
        p0.data = p0.data.clone() + 1
        fresh = actor.flat_buckets(m)
        r["replanned"] = actor.flat.plan is not fe
        r["stale_vs_iter"] = _same(m, fresh, list(actor.export_tensors()))
        actor.shutdown()
    # parameters in another dtype than the export: no flat buckets (the pack path casts)
    cast = MegatronActor(config, weights_dir=hf_dir, params_dtype=torch.float32, export_dtype=torch.bfloat16)
    m = ManifestCache().manifest(cast.export_metas(), version=1, sync_id="s", bucket_bytes=1 << 22)
    rep["cast_flat_is_none"] = cast.flat_buckets(m) is None
    ref = [(x.name, hf[x.name].to(torch.bfloat16)) for x in cast.export_metas()]
    rep["cast_iter_vs_hf"] = _same(m, _pack_all(m, cast.export_tensors()), ref)
    rep["fp8"] = {str(bucket): run_fp8(config, hf_dir, bucket) for bucket in FP8_BUCKETS}
    return rep


def run_fp8(config, hf_dir: str, bucket: int) -> dict:
    """A block-FP8 layout: FlatExport quantizes into the buckets (weightsync/formats/fp8/quantize_slots.py)
    what the per-tensor export (export.export_tensors) packs, byte for byte, before and after a
    step; a nan weight lowers the flag and is named as the per-tensor export names it."""
    from trainer_svc.actor.megatron.actor import MegatronActor
    from trainer_svc.actor.megatron.flat_export import FlatExport
    from weightsync.bus.layout import ManifestCache
    from weightsync.formats.fp8.export import export_metas, export_tensors
    from weightsync.formats.fp8.spec import BLOCK_FP8

    kernel = os.environ.get("FLAT_CASES_KERNEL") == "1"
    r: dict = {}
    # fp8-block: the actor exports float32 (publisher/export_format.actor_dtype), its parameters are bf16
    actor = MegatronActor(config, weights_dir=hf_dir, params_dtype=torch.bfloat16, export_dtype=torch.float32)
    metas = export_metas(actor.export_metas())
    m = ManifestCache().manifest(
        metas, version=1, sync_id="s", bucket_bytes=bucket, model_family=actor.family, quantization=BLOCK_FP8
    )
    r["buckets"] = len(m.buckets)
    slot_bucket = {s.meta.name: b.index for b in m.buckets for s in b.slots}
    r["scale_apart"] = sum(
        slot_bucket[n] != slot_bucket[n[: -len("_scale_inv")]] for n in slot_bucket if n.endswith("_scale_inv")
    )
    want = _pack_all(m, export_tensors(actor.export_tensors()))
    fe = FlatExport(m, actor.model, actor.spec, use_kernel=kernel)
    flats = fe.refresh()
    r["flat_vs_iter"] = [b.index for b, f, w in zip(m.buckets, flats, want) if not torch.equal(f[: b.nbytes], w)]
    r["finite"] = fe.finite()
    # the quantizer's sums of its slots plus a read of the other bytes: each bucket's checksum
    from weightsync.bus.copy.checksum import InFlightChecksums, bucket_checksum

    known = fe.known_sums()
    views = [f[: b.nbytes] for b, f in zip(m.buckets, flats)]
    r["known_sums"] = known is not None
    r["known_vs_read"] = known is not None and (
        InFlightChecksums(views, known).values() == [bucket_checksum(v) for v in views]
    )
    r["quantized_bytes"], r["quant_launches"], r["copies"] = fe.quantized_bytes, fe.quant_launches, fe.copies
    r["launches"], r["torch_copies"], r["aliased_bytes"] = fe.launches, fe.torch_copies, fe.aliased_bytes
    r["fp8_bytes"] = sum(x.nbytes for x in metas if x.dtype == torch.float8_e4m3fn or x.name.endswith("_scale_inv"))
    r["total_bytes"] = sum(x.nbytes for x in metas)
    with torch.no_grad():
        for i, p in enumerate(actor.parameters()):
            p.mul_(1.5 + 0.25 * i)
    fe.refresh()
    want = _pack_all(m, export_tensors(actor.export_tensors()))
    r["after_step_vs_iter"] = [b.index for b, f, w in zip(m.buckets, flats, want) if not torch.equal(f[: b.nbytes], w)]
    r["trainer_writes"] = trainer_writes(fe, m, flats)
    bad = "model.layers.0.mlp.down_proj.weight"
    mname = "decoder.layers.0.mlp.linear_fc2.weight"
    from trainer_svc.actor.megatron.model import named_parameters_global

    with torch.no_grad():
        named_parameters_global(actor.model)[mname][1, 2] = float("nan")
    r["nan_writes_error"] = trainer_writes(fe, m, flats)["error"]
    fe.refresh()
    r["nan_finite"] = fe.finite()
    r["nan_error"] = str(fe.non_finite_error())
    try:
        for _ in export_tensors(actor.export_tensors()):
            pass
        r["iter_error"] = ""
    except ValueError as exc:
        r["iter_error"] = str(exc)
    r["bad"] = bad
    actor.shutdown()
    return r


def trainer_writes(fe, m, flats) -> dict:
    """ipc trainer_writes of the FP8 layout from the actor's own buckets (weightsync/formats/
    fp8/trainer_writes.py) into a bf16 engine, its FP8 slots not quantized first (poisoned: never read):
    the engine's parameters and the bucket checksums against the rollout_reads path's (the quantized
    buckets dequantized by the rollout's FusedDequant, the checksums of their bytes)."""
    from tests.support.fake_gpu import FakeGpu
    from weightsync.bus.copy.checksum import bucket_checksum
    from weightsync.bus.ipc.trainer_writes import Destinations, offer
    from weightsync.bus.plan import TensorMeta
    from weightsync.formats.fp8.dequantize_slots import FusedDequant
    from weightsync.formats.fp8.trainer_writes import Fp8Writes

    out: dict = {"error": ""}
    writes = Fp8Writes()
    allowed = writes.destination_dtypes(m)
    slots = [s.meta for b in m.buckets for s in b.slots]
    # each FP8 weight as a bf16 parameter (allowed: bf16 or float32), the rest as sent, no scale
    wanted = [None if not ok else TensorMeta(x.name, x.shape, ok[0]) for x, ok in zip(slots, allowed)]
    engine = {w.name: torch.full(w.shape, float("nan"), dtype=w.dtype) for w in wanted if w is not None}
    ref = {n: torch.empty_like(t) for n, t in engine.items()}
    # rollout_reads: the quantized buckets, dequantized by the rollout's kernel path (torch here)
    fe.refresh()
    views = [f[: b.nbytes] for b, f in zip(m.buckets, flats)]
    fused = FusedDequant()
    held = fused.begin(m)
    want_sums, at = [], 0
    for plan, v in zip(m.buckets, views):
        params = [None if w is None else ref[w.name] for w in wanted[at : at + len(plan.slots)]]
        at += len(plan.slots)
        want_sums.append(bucket_checksum(v))
        assert fused.copy(plan, v, params, held) == want_sums[-1]
    # trainer_writes: the FP8 slots poisoned and not quantized; the writer dequantizes from the parameters
    fe.refresh(quantize=False)
    for b, ranges in enumerate(fe._quant.slot_ranges()):
        for start, end in ranges:
            flats[b][start:end] = 0xAB
    gpu = FakeGpu()
    table = offer(m, [engine[w.name] for w in wanted if w is not None], gpu.share, wanted)
    dests = Destinations(m, table, gpu.open, allowed)
    sender = writes.sender(dests, "r", m)
    out["fused"] = sender.write_fp8_from(fe.fp8_weights())
    try:
        assert sender.send_held(list(m.buckets), views)
        sender.flush()
    except ValueError as exc:
        out["error"] = str(exc)
        return out
    out["sums_equal"] = sender.checksums() == want_sums
    out["params_differ"] = sorted(n for n, t in ref.items() if not torch.equal(engine[n], t))
    out["engine_dtypes"] = sorted({str(t.dtype) for t in engine.values()})
    return out


def _force_kernel() -> None:
    from weightsync.bus.copy import copy_runs

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
    # the report is written: end without the interpreter's teardown of torch and megatron (seconds
    # per process on a busy 2-core box, paid by every rank of every launch)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
