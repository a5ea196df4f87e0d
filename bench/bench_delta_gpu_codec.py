"""The delta codec on one GPU: torch ops vs the fused Triton kernels (weightsync/bus/delta/codec_triton.py).

For each `--models` shape (its bf16 export's bytes, in buckets of `--bucket-mb`, default the trainer's
1024) and each `--densities` fraction of changed bf16 words, per path (median of `--reps` after a
warm-up, synchronized around each pass over every bucket):
- encode:  delta.diff + delta.encode (the trainer's compare and encode: what `auto` weighs against the link)
- trainer: that plus the checksum's sums change and the base's update (DeltaStream.encode + store)
- apply:   delta.apply_delta with the base's word sums (the rollout), onto a copy already patched: the same work
Reported in GB/s of bucket, with the payload's share of the bytes (torch picks the smaller of bitmap and
gaps; the fused path always sends the bitmap). The torch path is forced by making delta.py see no
Triton. `--configs 4096x8,2048x16,4096x16,1024x8` also times the fused path at other block sizes and
warps (the first is the row's); `triton_compare_torch_gaps`: the fused compare with torch's encoder on
its positions (gaps: the smaller wire). Checked first: the fused payload is the torch bitmap
(delta.encode(kind=BITMAP)) byte for byte and both applies are exact.

    python -m bench delta_codec
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.common.models import export_bytes  # noqa: E402
from bench.common.results import write_result  # noqa: E402
from bench.common.timing import cuda_median_s  # noqa: E402

PASSES = ("encode", "trainer", "apply")
DEV = torch.device("cuda:0")


def _buckets(total: int, bucket: int, density: float, seed: int):
    dev = DEV
    g = torch.Generator(device=dev).manual_seed(seed)
    news, bases = [], []
    for start in range(0, total, bucket):
        n = min(bucket, total - start)
        n -= n % 4
        base = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=g)
        new = base.clone()
        w = new.view(torch.int16)
        for lo in range(0, w.numel(), 1 << 26):  # positions in steps: torch.rand of a whole bucket is 4x its bytes
            part = w[lo : lo + (1 << 26)]
            pos = (torch.rand(part.numel(), device=dev, generator=g) < density).nonzero().squeeze(1)
            part[pos] ^= 0x21
        news.append(new)
        bases.append(base)
    return news, bases


def run_path(news, bases, copies, sums, reps: int) -> dict:
    from weightsync.bus.delta import codec as delta

    def encode():
        return [delta.encode(nw, b, 2, delta.diff(nw, b, 2)) for nw, b in zip(news, bases)]

    def trainer():
        for nw, b, c, s in zip(news, bases, copies, sums):
            d = delta.diff(nw, b, 2)
            delta.encode(nw, b, 2, d)
            s + d.sums_change()  # noqa: B018 (the incremental checksum's device work)
            d.write(c)  # onto the patched copy: the same words written

    payloads = encode()

    def apply():
        for p, c, s in zip(payloads, copies, sums):
            delta.apply_delta(p, c, s)

    total = sum(nw.numel() for nw in news)
    res = {"payload_ratio": sum(p.numel() for p in payloads) / total}
    for name, fn in zip(PASSES, (encode, trainer, apply)):
        s = cuda_median_s(fn, reps)
        res[name] = {"seconds": s, "gb_per_s": total / 1e9 / s}
    return res


def fused_compare_torch_gaps(news, bases, reps: int) -> dict:
    """The alternative to the bitmap on the fused path: the fused compare, then torch's encoder (the smaller
    of bitmap and gaps) on the positions unpacked from the bitmap. Its rate and payload next to the
    fused bitmap's say whether the smaller wire is worth its encode (a threshold on the changed count)."""
    from weightsync.bus.delta import codec as delta

    def encode():
        return [delta.encode(nw, b, 2, delta.diff(nw, b, 2).idx) for nw, b in zip(news, bases)]

    total = sum(nw.numel() for nw in news)
    payloads = encode()
    s = cuda_median_s(encode, reps)
    return {
        "payload_ratio": sum(p.numel() for p in payloads) / total,
        "encode": {"seconds": s, "gb_per_s": total / 1e9 / s},
    }


def check(news, bases, sums) -> None:
    """The fused payload is the torch bitmap byte for byte; both applies exact, with the sums."""
    from weightsync.bus.copy.checksum import word_sums
    from weightsync.bus.delta import codec as delta

    nw, b, s = news[0], bases[0], sums[0]
    fused = delta.encode(nw, b, 2)
    with torch_only():
        want = delta.encode(nw, b, 2, kind=delta.BITMAP)
        smallest = delta.encode(nw, b, 2)
        c = b.clone()
        a = delta.apply_delta(smallest, c, s)
        assert torch.equal(c, nw) and torch.equal(a.sums, word_sums(nw.view(torch.int32)))
    assert (fused is None and want is None) or torch.equal(fused, want), "fused payload differs from torch's bitmap"
    if fused is not None:
        c = b.clone()
        a = delta.apply_delta(fused, c, s)
        assert torch.equal(c, nw) and torch.equal(a.sums, word_sums(nw.view(torch.int32)))


class torch_only:
    """delta.py sees no Triton inside: its torch ops run on the GPU."""

    def __enter__(self):
        from weightsync.bus.delta import codec as delta

        self._real = delta._fused
        delta._fused = lambda buf: None

    def __exit__(self, *exc):
        from weightsync.bus.delta import codec as delta

        delta._fused = self._real


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="1.5b,7b")
    ap.add_argument("--densities", default="0.01,0.02,0.03")
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", default="4096x8", help="fused path: BLOCKxWARPS list; the first is the row's")
    ap.add_argument("--out", default="", help="result file or directory (default: bench/results/)")
    args = ap.parse_args(argv)
    from weightsync.bus.copy.checksum import word_sums
    from weightsync.bus.delta import codec_triton as delta_cuda

    if not delta_cuda.available():
        print("needs a CUDA GPU and triton", file=sys.stderr)
        return 2
    rows, default = [], (delta_cuda.BLOCK, delta_cuda.WARPS)
    for model in args.models.split(","):
        total = export_bytes(model)
        for density in (float(x) for x in args.densities.split(",")):
            news, bases = _buckets(total, args.bucket_mb << 20, density, seed=int(density * 1000))
            sums = [word_sums(b.view(torch.int32)) for b in bases]
            check(news, bases, sums)
            copies = [b.clone() for b in bases]
            row = {"model": model, "bytes": sum(n.numel() for n in news), "buckets": len(news), "density": density}
            with torch_only():
                row["torch"] = run_path(news, bases, copies, sums, args.reps)
            for i, config in enumerate(args.configs.split(",")):
                # words per program and warps (tuning knobs: the kernels compile per value)
                delta_cuda.BLOCK, delta_cuda.WARPS = (int(x) for x in config.split("x"))
                row["triton" if i == 0 else f"triton_{config}"] = run_path(news, bases, copies, sums, args.reps)
                row.setdefault("configs", []).append(config)
            delta_cuda.BLOCK, delta_cuda.WARPS = default
            row["triton_compare_torch_gaps"] = fused_compare_torch_gaps(news, bases, args.reps)
            rows.append(row)
            for key in [k for k in row if k.startswith("triton_")]:
                rates = ", ".join(f"{k} {row[key][k]['gb_per_s']:.1f} GB/s" for k in PASSES if k in row[key])
                print(f"  {key}: {rates}; payload {row[key]['payload_ratio']:.4f}x", flush=True)
            t, f = row["torch"], row["triton"]
            print(
                f"{model} {row['bytes'] / 1e9:.2f} GB, {density:.0%} changed: "
                + ", ".join(
                    f"{k} torch {t[k]['gb_per_s']:.1f} / triton {f[k]['gb_per_s']:.1f} GB/s"
                    for k in ("encode", "trainer", "apply")
                )
                + f"; payload torch {t['payload_ratio']:.4f}x / triton {f['payload_ratio']:.4f}x",
                flush=True,
            )
            del news, bases, copies, sums
            torch.cuda.empty_cache()
    for row in rows:  # each pass's seconds on both paths, flat, next to each other
        for path in ("torch", "triton"):
            row.update({f"{path}_{k}_s": row[path][k]["seconds"] for k in PASSES})
    baseline = {"what": "the torch ops (delta.py without Triton) on the same buckets", "rows_key": "torch_encode_s"}
    write_result("delta_codec", rows, baseline=baseline, out=args.out or None, bucket_mb=args.bucket_mb, reps=args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
