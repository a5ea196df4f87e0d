"""The block-FP8 flat sync's kernels alone, each against a plain copy of bytes on the same device.

One process, one rank (TP=PP=EP=1): a Qwen2-shaped megatron model (bench/common/models.py's MODELS,
`--shape`) with bf16 parameters filled with N(0, 0.02), a block-FP8 manifest of `--bucket-mb`
buckets, and the trainer's flat export of it (trainer_svc/actor/megatron/flat_export.py), as a
colocated sync uses them. Timed separately (CUDA events on a GPU, the median of `--reps` after a
warm-up; wall clock with the interpreter):

- `quant`: the quant_slots launches of every bucket (weightsync/formats/fp8_slots.py), what the
  trainer's prepare.in_place waits for; reads the FP8 weights' bf16 rows, writes e4m3 + scales;
- `copies`: the converted bf16 copies of the same refresh (QKV biases, padded vocabulary, ...);
- `refresh`: FlatExport.refresh() + finite(): the whole prepare.in_place of a sync;
- `checksum`: word sums of every whole bucket (bus/checksum.py), as the trainer read them before;
- `checksum_rest`: what it reads now: the buckets' bytes outside the FP8 and scale slots, whose
  word sums the quantizer keeps as it writes them (checked: those + these == the checksums), and
  `quant_nosums`, the quantize launches without keeping them (the A/B of the sums' cost);
- `dequant`: the rollout's fused dequantize of every bucket into engine parameters (bf16), its
  checksum included (weightsync/formats/fp8_dequant_slots.py), what the built-in engine's commit does;
- `fused_write`: the FP8 weights quantized and dequantized in one launch straight from the parameters
  into the engine's (weightsync/formats/fp8_write.py), their e4m3 and scale words summed, never stored;
  `trainer_writes`: that plus the copy-and-checksum launch of every other byte of the buckets
  (verified_copy.copy_all_into, FP8 and scale slots left out): the whole GPU work of a block-FP8 ipc
  trainer_writes sync from the actor's own buckets (no `quant` at prepare; checked: the same engine
  values as `dequant` and the same checksums as the FP8 buckets');
- `copy`: a plain `copy_` of every bucket's bytes into a scratch buffer: the bandwidth baseline;
- `quant_narrow`, `dequant_narrow` (with the kernels, unless `--no-narrow`): the same launches at
  VEC = 1 and every word run narrow, so each access moves one element, as both kernels did before
  their launches carried the widest access their tables allow: the A/B of that change; and
  `quant_block128`, `dequant_block128`: programs holding a whole 128-row block with 8 warps, as
  before the 32-row tiles (the A/B of those).

GB/s counts the bytes an ideal kernel moves: read + written once each (the checksum: read only).
Every result is checked: the quantized buckets against the torch reference (fp8.quantize_torch,
tensor by tensor) and the dequantized parameters against the torch path of the same plan, by
checksum. `--profile`: a torch.profiler kernel summary of one refresh + checksum + dequant.

    python -m bench fp8_slots --shape 7b --reps 10                        # one GPU, < 3 min
    TRITON_INTERPRET=1 python -m bench fp8_slots --shape tiny --reps 1    # CPU, the kernels interpreted
    python -m bench fp8_slots --shape tiny --reps 1 --torch               # CPU, the torch paths
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402 (after the repo root is on the path)

from bench.common.results import write_result  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `reps` calls of `fn` after `warmup` ones: CUDA events around the call on a
    GPU (the device's time, not the host's), the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def make_actor(shape: str):
    from bench.common.models import MODELS, qwen2_config
    from trainer_svc.actor.megatron.actor import MegatronActor

    # fp8-block: the actor exports float32 (publisher/export_format.actor_dtype), its parameters are bf16
    actor = MegatronActor(
        qwen2_config(MODELS[shape]), params_dtype=torch.bfloat16, export_dtype=torch.float32, init_weights=False
    )
    g = torch.Generator(device=actor.parameters()[0].device).manual_seed(0)
    with torch.no_grad():
        for p in actor.parameters():  # finite weights of a trained model's scale: every block quantizes
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).mul_(0.02))
    return actor


def _at(p: torch.Tensor, flat: torch.Tensor) -> slice:
    """The byte range of view `p` of `flat`."""
    start = p.data_ptr() - flat.data_ptr()
    return slice(start, start + p.numel() * p.element_size())


def engine_params(manifest, dev: torch.device):
    """Per bucket, the parameter of each slot as a built-in engine holds it (bf16; None for a scale),
    all views of one flat buffer (256-byte aligned, as allocations are) so one checksum covers them."""
    from weightsync.formats.fp8.spec import FP8_DTYPE, SCALE_DTYPE, SCALE_SUFFIX

    places, pos = [], 0
    for b in manifest.buckets:
        row = []
        for s in b.slots:
            m = s.meta
            if m.dtype == SCALE_DTYPE and m.name.endswith(SCALE_SUFFIX):
                row.append(None)
                continue
            dtype = torch.bfloat16 if m.dtype == FP8_DTYPE else m.dtype
            n = 1
            for d in m.shape:
                n *= d
            row.append((pos, dtype, m.shape, n))
            pos += -(-(n * dtype.itemsize) // 256) * 256
        places.append(row)
    flat = torch.zeros(pos, dtype=torch.uint8, device=dev)
    params = [
        [None if p is None else flat[p[0] : p[0] + p[3] * p[1].itemsize].view(p[1]).view(p[2]) for p in row]
        for row in places
    ]
    return flat, params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="7b", help="a bench/common/models.py MODELS row: tiny, 0.5b, 1.5b, 7b")
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--torch", action="store_true", help="the torch paths instead of the Triton kernels")
    ap.add_argument("--profile", action="store_true", help="a torch.profiler kernel summary of one sync's kernels")
    ap.add_argument("--no-narrow", action="store_true", help="skip the A/B of the one-element-per-access variants")
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)

    from trainer_svc.actor.megatron.flat_export import FlatExport
    from weightsync.bus.copy import checksum
    from weightsync.bus.copy.checksum import InFlightChecksums
    from weightsync.bus.copy.checksum_regions import others
    from weightsync.bus.layout import ManifestCache
    from weightsync.formats.fp8.dequantize_slots import FusedDequant
    from weightsync.formats.fp8.export import export_metas
    from weightsync.formats.fp8.spec import BLOCK_FP8, FP8_DTYPE, SCALE_SUFFIX
    from weightsync.triton_support import available

    t0 = time.perf_counter()
    actor = make_actor(args.shape)
    dev = actor.parameters()[0].device
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if args.torch:
        kernel = False
    elif dev.type == "cuda":
        kernel = available()
    else:
        kernel = interpreted  # the kernels under Triton's interpreter (tests do the same)
    manifest = ManifestCache().manifest(
        export_metas(actor.export_metas()),
        version=1,
        sync_id="bench",
        bucket_bytes=args.bucket_mb << 20,
        model_family=actor.family,
        checksum_algo="ws-sum64-v1",
        quantization=BLOCK_FP8,
    )
    fe = FlatExport(manifest, actor.model, actor.spec, use_kernel=kernel)
    flats = fe.flats
    views = [f[: b.nbytes] for f, b in zip(flats, manifest.buckets)]
    eflat, eparams = engine_params(manifest, dev)
    build_s = time.perf_counter() - t0

    metas = [s.meta for b in manifest.buckets for s in b.slots]
    fp8_elems = sum(m.nbytes for m in metas if m.dtype == FP8_DTYPE)
    scale_bytes = sum(m.nbytes for m in metas if m.name.endswith(SCALE_SUFFIX))
    plain_bytes = sum(m.nbytes for m in metas) - fp8_elems - scale_bytes
    bucket_bytes = sum(b.nbytes for b in manifest.buckets)
    # bytes an ideal pass moves (read + written once)
    moved = {
        "quant": 2 * fp8_elems + fp8_elems + scale_bytes,
        "copies": 2 * fe.copied_bytes,
        "refresh": 2 * fp8_elems + fp8_elems + scale_bytes + 2 * fe.copied_bytes,
        "checksum": bucket_bytes,
        "dequant": bucket_bytes + 2 * fp8_elems + plain_bytes,
        "copy": 2 * bucket_bytes,
    }

    fused = FusedDequant(use_kernel=kernel)
    scratch = torch.empty(max(b.nbytes for b in manifest.buckets), dtype=torch.uint8, device=dev)
    whole = [v.numel() - v.numel() % 4 for v in views]
    table = checksum._many_table(views, whole) if dev.type == "cuda" else None

    def quant():
        with torch.no_grad():
            fe._quant.run()

    def copies():
        with torch.no_grad():
            fe._copy.run()

    def refresh():
        fe.refresh()
        if not fe.finite():
            raise RuntimeError(f"non-finite FP8 block: {fe.non_finite_error()}")

    fe.refresh()
    known = fe.known_sums()  # the quantizer's sums of its slots (None: a weight that is not whole words)
    rest = [others(r, w) for r, w in zip(known.ranges, whole)] if known is not None else None

    def sums():
        return checksum._many_word_sums(table, views, whole)

    def sums_rest():  # what a sync reads since the quantizer sums its slots (stream_phase.start_in_place)
        return [checksum.region_word_sums(v, r) for v, r in zip(views, rest)]

    def dequant():
        held = fused.begin(manifest)
        out = []
        for plan, v, params in zip(manifest.buckets, views, eparams):
            r = fused.copy(plan, v, params, held, wait=False)
            if r is None:
                raise RuntimeError(f"bucket {plan.index}: the fused dequantize declined it")
            out.append(r)
        return out

    def copy():
        for v in views:
            scratch[: v.numel()].copy_(v)

    def narrow(fn):
        """`fn` with every launch's VEC (and WV) at 1: each access moves one element, as both kernels
        did before their launches carried the widest access their tables allow (the A/B)."""

        def run():
            q, plans = fe._quant.launches, dict(fused._plans)
            fe._quant.launches = [la._replace(vec=1) for la in q]
            for key, p in plans.items():
                words = p.tables[0].clone()
                words[:, 4] = 0
                fused._plans[key] = dataclasses.replace(p, tables=(words, *p.tables[1:-1], 1))
            try:
                return fn()
            finally:
                fe._quant.launches = q
                fused._plans.update(plans)

        return run

    from weightsync.bus.copy.verified_copy import copy_all_into, pending_values
    from weightsync.formats.fp8 import write_slots as fp8_write

    fp8_names = {m.name for m in metas if m.dtype == FP8_DTYPE}
    by_name = {s.meta.name: e for b, row in zip(manifest.buckets, eparams) for s, e in zip(b.slots, row)}
    writer = fp8_write.plan(
        fe.fp8_weights(), [by_name[w.name] for w in fe.fp8_weights()], len(manifest.buckets), use_kernel=kernel
    )
    rest_dests = [
        [None if s.meta.name in fp8_names else e for s, e in zip(b.slots, row)]
        for b, row in zip(manifest.buckets, eparams)
    ]
    prepared: dict = {}

    def fused_write():
        with torch.no_grad():
            return writer.run()

    def trainer_writes():  # Fp8TrainerWriteSender.send_held's GPU work, without the host's reads
        fp8 = fused_write()
        pending = copy_all_into(manifest.buckets, views, rest_dests, prepared=prepared)
        for i, p in enumerate(pending):
            p.sums += fp8[i]  # in place: the launch reads its rows at once (PendingChecksum.rows)
        return pending

    moved["fused_write"] = 2 * fp8_elems + 2 * fp8_elems  # bf16 rows read, bf16 values written
    moved["trainer_writes"] = moved["fused_write"] + 2 * plain_bytes

    steps = {"quant": quant, "copies": copies, "refresh": refresh, "checksum": sums, "dequant": dequant, "copy": copy}
    if writer is not None:
        steps["fused_write"], steps["trainer_writes"] = fused_write, trainer_writes
    if writer is not None and kernel:
        for rows, warps in ((16, 4), (32, 4), (32, 8), (64, 8)):  # the A/B of the fused write's tile

            def tiled(rows=rows, warps=warps):
                saved = (fp8_write.TILE_ROWS, fp8_write.NUM_WARPS)
                fp8_write.TILE_ROWS, fp8_write.NUM_WARPS = rows, {True: warps, False: warps}
                try:
                    return fused_write()
                finally:
                    fp8_write.TILE_ROWS, fp8_write.NUM_WARPS = saved

            steps[f"fused_write_r{rows}w{warps}"] = tiled
            moved[f"fused_write_r{rows}w{warps}"] = moved["fused_write"]
    if rest is not None:
        steps["checksum_rest"] = sums_rest
        moved["checksum_rest"] = sum(e - s for r in rest for s, e in r)

        def quant_nosums():  # the A/B of the word sums the quantizer keeps for the checksums
            fe._quant.keep_sums = False
            try:
                quant()
            finally:
                fe._quant.keep_sums = True

        steps["quant_nosums"] = quant_nosums
        moved["quant_nosums"] = moved["quant"]

    def whole_blocks(step: str):
        """The quantize or the dequantize with programs holding a whole 128-row block (8 warps), as
        before the 32-row tiles (the A/B of that change; the dequantize planned afresh for it)."""
        from weightsync.formats.fp8 import dequantize_slots_triton as dk
        from weightsync.formats.fp8 import quantize_slots_triton as qk

        other = FusedDequant(use_kernel=kernel)

        def run():
            saved = (qk.TILE_ROWS, qk.NUM_WARPS, dk.TILE_ROWS, dk.NUM_WARPS)
            qk.TILE_ROWS, qk.NUM_WARPS, dk.TILE_ROWS, dk.NUM_WARPS = 128, 8, 128, 8
            try:
                if step == "quant":
                    return quant()
                held = other.begin(manifest)
                return [other.copy(p, v, e, held, wait=False) for p, v, e in zip(manifest.buckets, views, eparams)]
            finally:
                qk.TILE_ROWS, qk.NUM_WARPS, dk.TILE_ROWS, dk.NUM_WARPS = saved

        return run

    if kernel and not args.no_narrow:
        steps["quant_block128"] = whole_blocks("quant")
        steps["dequant_block128"] = whole_blocks("dequant")
        moved["quant_block128"], moved["dequant_block128"] = moved["quant"], moved["dequant"]
        dequant()  # plans the dequantize (narrow() changes the plans)
        steps["quant_narrow"] = narrow(quant)
        steps["dequant_narrow"] = narrow(dequant)
        moved["quant_narrow"], moved["dequant_narrow"] = moved["quant"], moved["dequant"]
    rec = {
        "shape": args.shape,
        "kernels": "triton-interpreted" if kernel and dev.type != "cuda" else ("triton" if kernel else "torch"),
        "build_s": build_s,
        "buckets": len(manifest.buckets),
        "bucket_bytes": bucket_bytes,
        "fp8_bytes": fp8_elems,
        "scale_bytes": scale_bytes,
        "plain_bytes": plain_bytes,
        "quant_launches": fe.quant_launches,
        "copy_launches": fe.launches,
        "steps": {},
    }
    print(
        f"{args.shape} on {dev} ({rec['kernels']}): {len(manifest.buckets)} buckets, "
        f"{bucket_bytes / 1e9:.3f} GB on the bus, {fp8_elems / 1e9:.3f} G FP8 elements, "
        f"{fe.quant_launches} quant launches",
        flush=True,
    )
    print(f"{'step':>14} {'median ms':>10} {'min ms':>9} {'GB moved':>9} {'GB/s':>8}  vs copy")
    for name, fn in steps.items():
        s = timed(fn, dev, args.reps)
        med = statistics.median(s)
        rec["steps"][name] = {"s_all": s, "s": med, "bytes_moved": moved[name], "gbps": moved[name] / med / 1e9}
    base = rec["steps"]["copy"]["gbps"]
    for name, r in rec["steps"].items():
        r["vs_copy_bandwidth"] = r["gbps"] / base
        print(
            f"{name:>14} {r['s'] * 1e3:10.3f} {min(r['s_all']) * 1e3:9.3f} {r['bytes_moved'] / 1e9:9.3f} "
            f"{r['gbps']:8.1f}  {r['vs_copy_bandwidth']:.2f}",
            flush=True,
        )

    if kernel:  # the widest accesses the launches' tables allow (16 elements, 4 words: 16 bytes)
        rec["quant_vec"] = sorted({la.vec for la in fe._quant.launches})
        rec["fused_write_vec"] = sorted({la.vec for la in writer.launches}) if writer is not None else []
        rec["dequant_vec"] = sorted({p.tables[-1] for p in fused._plans.values()})
        w = [p.tables[0] for p in fused._plans.values()]
        rec["dequant_wide_words"] = sum(int((t[:, 1] * t[:, 4]).sum()) for t in w) / max(
            1, sum(int(t[:, 1].sum()) for t in w)
        )
        print(
            f"launch VEC: quant {rec['quant_vec']}, dequant {rec['dequant_vec']}, fused write "
            f"{rec['fused_write_vec']}; "
            f"{rec['dequant_wide_words']:.3f} of the dequant's words 4 per access"
        )

    # correctness: the kernels' bytes against the torch paths of the same plans
    refresh()
    got = [checksum.bucket_checksum(v) for v in views]
    fe._quant._run_torch()
    want = [checksum.bucket_checksum(v) for v in views]
    rec["quant_matches_torch"] = got == want
    if rest is not None:  # the quantizer's own sums + the rest, as a sync computes the checksums
        refresh()
        rec["known_sums_match"] = InFlightChecksums(views, fe.known_sums()).values() == want
        print(f"quantizer's sums + the other bytes == bucket checksums: {rec['known_sums_match']}")
    dequant()
    _sync(dev)
    got_e = checksum.bucket_checksum(eflat)
    eflat.zero_()
    ref = FusedDequant(use_kernel=False)
    held = ref.begin(manifest)
    for plan, v, params in zip(manifest.buckets, views, eparams):
        ref.copy(plan, v, params, held)
    rec["dequant_matches_torch"] = got_e == checksum.bucket_checksum(eflat)
    ref_e = eflat.clone()
    print(f"quant == torch reference: {rec['quant_matches_torch']}; dequant == torch: {rec['dequant_matches_torch']}")
    if writer is not None:  # the trainer's fused write: the rollout's dequantized values, the FP8 buckets' sums
        refresh()
        want_sums = [checksum.bucket_checksum(v) for v in views]
        eflat.fill_(0xAB)
        got_sums = pending_values(trainer_writes())
        _sync(dev)
        values_match = checksum.bucket_checksum(eflat) == got_e
        rec["trainer_writes_matches"] = got_sums == want_sums and values_match
        print(
            f"trainer_writes == dequant of the FP8 buckets (values, checksums): {rec['trainer_writes_matches']} "
            f"(checksums {got_sums == want_sums}, values {values_match})"
        )
        if not values_match:  # where: the first parameters whose bytes differ from the torch dequantize's
            off = [(b.slots[i].meta.name, p) for b, row in zip(manifest.buckets, eparams) for i, p in enumerate(row)]
            diff = [
                (n, int((p.reshape(-1).view(torch.uint8) != ref_e[_at(p, eflat)]).sum()))
                for n, p in off
                if p is not None
            ]
            diff = [d for d in diff if d[1]]
            rec["trainer_writes_differs"] = diff[:20]
            print(
                f"  {len(diff)} parameters differ, first {diff[:6]}; bytes outside them differ: "
                f"{int((eflat != ref_e).sum()) - sum(d for _, d in diff)}"
            )

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            refresh()
            sums()
            dequant()
            _sync(dev)
        events = prof.key_averages()
        key = "self_cpu_time_total"
        if dev.type == "cuda":  # torch >= 2.4 names it for any device; older ones for CUDA
            key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        table_txt = events.table(sort_by=key, row_limit=20)
        print(table_txt)
        rec["profile"] = table_txt
    actor.shutdown()
    steps = rec.pop("steps")
    rows = [
        {"step": name, "median_s": r["s"], "samples_s": r.pop("s_all"), "copy_gbps": base, **r}
        for name, r in steps.items()
    ]
    baseline = {
        "what": "a plain copy_ of every bucket's bytes on the same device (the copy step)",
        "rows_key": "copy_gbps",
    }
    write_result("fp8_slots", rows, baseline=baseline, out=args.out or None, device=dev.type, **rec)
    ok = rec["quant_matches_torch"] and rec["dequant_matches_torch"] and rec.get("known_sums_match", True)
    ok = ok and rec.get("trainer_writes_matches", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
